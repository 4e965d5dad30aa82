package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/testutil"
)

func allowTopic(op kmsg.ACLOperation, name string) kfake.ACL {
	return kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: name, Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: op, Allow: true}
}

func allowGroup(name string) kfake.ACL {
	return kfake.ACL{Resource: kmsg.ACLResourceTypeGroup, Name: name, Pattern: kmsg.ACLResourcePatternTypeLiteral,
		Operation: kmsg.ACLOperationRead, Allow: true}
}

// hipqACLs are the ACLs docs/operations.md lists, for e2eConfig with an
// API: every role under one principal. Each says what fails without it,
// as hipq logs it.
var hipqACLs = []struct {
	role, grant string
	acl         kfake.ACL
	// Without it, hipq logs msg with an error holding err.
	msg, err string
}{
	{"intake", "READ topic jobs", allowTopic(kmsg.ACLOperationRead, "jobs"),
		"fetch error", "TOPIC_AUTHORIZATION_FAILED"},
	{"intake", "READ group e2e-intake", allowGroup("e2e-intake"),
		"fetch error", "GROUP_AUTHORIZATION_FAILED"},
	{"intake", "WRITE topic jobs.dlq", allowTopic(kmsg.ACLOperationWrite, "jobs.dlq"),
		"cannot copy dead letter to its topic; PostgreSQL keeps it", "TOPIC_AUTHORIZATION_FAILED"},
	{"dispatcher", "WRITE topic requests", allowTopic(kmsg.ACLOperationWrite, "requests"),
		"sends did not leave; pausing claims for it", "TOPIC_AUTHORIZATION_FAILED"},
	{"responses", "READ topic replies", allowTopic(kmsg.ACLOperationRead, "replies"),
		"fetch error", "TOPIC_AUTHORIZATION_FAILED"},
	{"responses", "READ group e2e-responses", allowGroup("e2e-responses"),
		"fetch error", "GROUP_AUTHORIZATION_FAILED"},
	{"responses, dispatcher, sweeper, api", "WRITE topic replies.dlq", allowTopic(kmsg.ACLOperationWrite, "replies.dlq"),
		"cannot copy dead letter to its topic; PostgreSQL keeps it", "TOPIC_AUTHORIZATION_FAILED"},
}

// Least privilege: against a broker with ACLs on, the whole loop runs
// with only the ACLs docs/operations.md lists (a job succeeds, both kinds
// of dead letter are copied to their topics, the dashboard reads the lag,
// nothing is refused), and without any one of them the action that needs
// it fails, saying so.
func TestLeastPrivilegeACLs(t *testing.T) {
	t.Parallel()
	for without := -1; without < len(hipqACLs); without++ {
		name := "all granted"
		if without >= 0 {
			name = "without " + hipqACLs[without].grant
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var granted []kfake.ACL
			for i, g := range hipqACLs {
				if i != without {
					granted = append(granted, g.acl)
				}
			}
			k := kafkatest.NewSecure(t, kafkatest.Secure{Mechanism: "SCRAM-SHA-256", ACLs: true,
				Users: []kafkatest.User{{Name: "hipq", Password: "hipq-password", ACLs: granted}}})
			e := newEnvWith(t, k, e2eTopics...)
			text, url := withAPI(t, withKafka(e2eConfig, `sasl: {mechanism: SCRAM-SHA-256, username: hipq, password: hipq-password}`), "")
			cfg := e.config(text)
			core, logs := observer.New(zapcore.WarnLevel)
			a, err := newApp(context.Background(), cfg, zap.New(core), appOptions{metadataMinAge: 100 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- a.run(ctx) }()
			t.Cleanup(func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("app: %v", err)
				}
				a.close()
			})
			e.respond(ctx, "requests", "replies", func(string, int) (string, bool) { return "succeeded", true })
			// A job, a bad job request and a reply of no job: each role's
			// every Kafka action.
			e.produce("jobs", jobReq("a"), "not json")
			e.produceTo(&kgo.Record{Topic: e.kafka.Topic("replies"), Value: []byte(`{"status":"succeeded"}`)})

			refused := func() []string {
				var out []string
				for _, l := range logs.All() {
					for _, f := range l.Context {
						if f.Type == zapcore.ErrorType && strings.Contains(f.Interface.(error).Error(), "AUTHORIZATION_FAILED") {
							out = append(out, l.Message+": "+f.Interface.(error).Error())
						}
					}
				}
				return out
			}
			if without >= 0 {
				g := hipqACLs[without]
				testutil.Eventually(t, 30*time.Second, func() (bool, string) {
					for _, l := range logs.FilterMessage(g.msg).All() {
						for _, f := range l.Context {
							if f.Type == zapcore.ErrorType && strings.Contains(f.Interface.(error).Error(), g.err) {
								return true, ""
							}
						}
					}
					return false, fmt.Sprint(refused())
				}, "%s to fail without %s: %q with %s", g.role, g.grant, g.msg, g.err)
				return
			}
			testutil.Eventually(t, 30*time.Second, func() (bool, string) {
				n := e.countJobs(a, "outcome = 'succeeded'")
				return n == 1, fmt.Sprintf("%d succeeded", n)
			}, "the job to succeed")
			for _, dlq := range []string{"jobs.dlq", "replies.dlq"} {
				readOne(t, k, dlq)
			}
			waitAPI(t, url)
			if r := getReady(t, http.DefaultClient, url); !r.Ready {
				t.Errorf("/readyz: %s", r.body)
			}
			if _, err := a.consumerLag(ctx); err != nil {
				t.Errorf("the dashboard's consumer lag: %v", err)
			}
			if r := refused(); len(r) > 0 {
				t.Errorf("refused with every ACL granted: %v", r)
			}
		})
	}
}

// readOne waits for a record on topic, read as the superuser.
func readOne(t *testing.T, k *kafkatest.Cluster, topic string) {
	t.Helper()
	cl := k.Client(kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		f := cl.PollFetches(ctx)
		if len(f.Records()) > 0 {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("no record on %s: %v", topic, f.Errors())
		}
	}
}

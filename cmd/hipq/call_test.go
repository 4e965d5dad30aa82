package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/client"
	"github.com/hipq/hipq/client/kafkaintake"
	"github.com/hipq/hipq/internal/testutil"
)

// kafkaintake's Caller is request/reply over Kafka: a call returns its
// job's outcome from the caller's reply topic, a failure included, and
// rides out a restart of hipq while it waits.
func TestCallOverKafka(t *testing.T) {
	t.Parallel()
	e := newEnv(t, eventsTopics...)
	cfg := e.config(eventsConfig())
	_, stop := e.startStoppable(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	release := make(chan struct{})
	e.respondAfter(ctx, "requests", "replies", func() time.Duration {
		<-release // (the replies to "later" wait for the restart)
		return 0
	}, func(key string, _ int) (string, bool) {
		return map[bool]string{true: "succeeded", false: "failed"}[key != "refused"], true
	})
	pc := e.kafka.Client()
	defer pc.Close()
	c, err := kafkaintake.NewCaller(ctx, kafkaintake.New(pc, e.kafka.Topic("jobs")), e.kafka.Topic("callers.a"),
		kgo.SeedBrokers(e.kafka.Brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	// A call waits while hipq restarts.
	type answer struct {
		o   kafkaintake.Outcome
		err error
	}
	got := make(chan answer, 1)
	go func() {
		o, err := c.Call(ctx, client.Job{Type: "e2e", Key: "later", Data: json.RawMessage(`{"n": 1}`)})
		got <- answer{o, err}
	}()
	testutil.Eventually(t, time.Minute, func() bool {
		return e.adminScalar("SELECT count(*) FROM hipq_job WHERE job_key = 'later' AND state = 'running'") == 1
	}, "the job sent")
	stop()
	e.start(cfg)
	close(release)
	a := <-got
	if a.err != nil || !a.o.Succeeded() || a.o.JobKey != "later" || a.o.JobID == 0 || a.o.EventID == "" {
		t.Fatalf("call across a restart: %+v, %v", a.o, a.err)
	}
	// A failure is an outcome, not an error (the type retries twice more).
	o, err := c.Call(ctx, client.Job{Type: "e2e", Key: "refused"})
	if err != nil || o.Outcome != "failed" || o.Error == nil || o.Attempt != 3 {
		t.Fatalf("failed call: %+v, %v", o, err)
	}
	// Calls at once each get their own.
	outs := make(chan answer, 3)
	for _, k := range []string{"x", "y", "z"} {
		go func() {
			o, err := c.Call(ctx, client.Job{Type: "e2e", Key: k})
			if err == nil && o.JobKey != k {
				err = context.Canceled
			}
			outs <- answer{o, err}
		}()
	}
	for range 3 {
		if a := <-outs; a.err != nil || !a.o.Succeeded() {
			t.Fatalf("concurrent call: %+v, %v", a.o, a.err)
		}
	}
}

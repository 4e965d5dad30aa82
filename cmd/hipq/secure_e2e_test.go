package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/internal/certtest"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/testutil"
)

// withKafka replaces the kafka line of e2eConfig with one holding extra
// keys (tls, sasl).
func withKafka(text, extra string) string {
	return strings.Replace(text, `kafka: {brokers: ["{{BROKERS}}"], session_timeout: 6s}`,
		`kafka: {brokers: ["{{BROKERS}}"], session_timeout: 6s, `+extra+`}`, 1)
}

// freeAddr is a free loopback address to listen on.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// readiness is what /readyz at addr answers.
type readiness struct {
	code   int
	body   string
	Ready  bool
	Checks map[string]string
}

func getReady(t *testing.T, client *http.Client, url string) readiness {
	t.Helper()
	resp, err := client.Get(url + "/readyz")
	if err != nil {
		return readiness{body: err.Error()}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	r := readiness{code: resp.StatusCode, body: string(b)}
	_ = json.Unmarshal(b, &r)
	return r
}

// The whole loop against a broker that demands mutual TLS, with a CA the
// test makes, and SCRAM-SHA-512: intake, dispatch, replies and readiness
// all get in.
func TestSecureKafkaRoundTrip(t *testing.T) {
	t.Parallel()
	ca, clientCA := certtest.NewCA(t, "kafka"), certtest.NewCA(t, "clients")
	hipqCert, testCert := clientCA.Client(t, "hipq"), clientCA.Client(t, "test")
	k := kafkatest.NewSecure(t, kafkatest.Secure{
		ServerTLS: ca.ServerTLS(t, []string{"kafka.internal"}, clientCA),
		ClientTLS: &tls.Config{RootCAs: ca.Pool(), ServerName: "kafka.internal", Certificates: []tls.Certificate{testCert.TLS}},
		Mechanism: "SCRAM-SHA-512", Users: []kafkatest.User{{Name: "hipq", Password: "hipq-password"}},
	})
	e := newEnvWith(t, k, e2eTopics...)
	addr := freeAddr(t)
	cfg := e.config(withKafka(e2eConfig, fmt.Sprintf(`
  tls: {enabled: true, ca_file: %q, server_name: kafka.internal, cert_file: %q, key_file: %q},
  sasl: {mechanism: SCRAM-SHA-512, username: hipq, password: hipq-password}`, ca.File, hipqCert.CertFile, hipqCert.KeyFile)) +
		fmt.Sprintf("metrics: {listen: %q}\n", addr))
	a := e.start(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.respond(ctx, "requests", "replies", func(string, int) (string, bool) { return "succeeded", true })
	var reqs []string
	for i := range 10 {
		reqs = append(reqs, jobReq(fmt.Sprintf("k-%d", i)))
	}
	e.produce("jobs", reqs...)
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(a, "outcome = 'succeeded'")
		return n == 10, fmt.Sprintf("%d succeeded", n)
	}, "every job to succeed over TLS and SCRAM")
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		r := getReady(t, http.DefaultClient, "http://"+addr)
		return r.Ready && r.Checks["kafka"] == "ok", r.body
	}, "/readyz ready")
}

// A broker that refuses hipq (a wrong password) or that hipq refuses (a
// certificate no trusted CA signed): hipq keeps running, /readyz says not
// ready naming the broker and the cause and never the password, the
// clients try again at a bounded rate, and once the broker lets hipq in
// the loop runs without a restart.
func TestKafkaRefusedIsReportedAndRetried(t *testing.T) {
	t.Parallel()
	const password = "hipq-password-that-must-not-show"
	cases := []struct {
		name  string
		setup func(t *testing.T) (k *kafkatest.Cluster, kafkaKeys string, admit func(), cause string)
	}{
		{"a wrong password", func(t *testing.T) (*kafkatest.Cluster, string, func(), string) {
			ca := certtest.NewCA(t, "kafka")
			k := kafkatest.NewSecure(t, kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"127.0.0.1"}),
				ClientTLS: &tls.Config{RootCAs: ca.Pool()}, Mechanism: "SCRAM-SHA-256",
				Users: []kafkatest.User{{Name: "hipq", Password: "another-password"}}})
			admit := func() { // the operator sets the password hipq has
				cl := k.Client()
				defer cl.Close()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				res, err := kadm.NewClient(cl).AlterUserSCRAMs(ctx, nil, []kadm.UpsertSCRAM{{User: "hipq",
					Mechanism: kadm.ScramSha256, Iterations: 4096, Password: password}})
				if err == nil {
					err = res.Error()
				}
				if err != nil {
					t.Fatalf("set hipq's password: %v", err)
				}
			}
			return k, fmt.Sprintf(`tls: {enabled: true, ca_file: %q}, sasl: {mechanism: SCRAM-SHA-256, username: hipq, password: %s}`,
				ca.File, password), admit, "SASL: authentication failed"
		}},
		{"a broker certificate no trusted CA signed", func(t *testing.T) (*kafkatest.Cluster, string, func(), string) {
			ca, rogue := certtest.NewCA(t, "kafka"), certtest.NewCA(t, "rogue")
			var serving atomic.Pointer[tls.Certificate]
			bad, good := rogue.Server(t, "kafka", "127.0.0.1").TLS, ca.Server(t, "kafka", "127.0.0.1").TLS
			serving.Store(&bad)
			both := x509.NewCertPool()
			both.AddCert(ca.Cert)
			both.AddCert(rogue.Cert)
			k := kafkatest.NewSecure(t, kafkatest.Secure{ClientTLS: &tls.Config{RootCAs: both},
				ServerTLS: &tls.Config{GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return serving.Load(), nil }}})
			return k, fmt.Sprintf(`tls: {enabled: true, ca_file: %q}`, ca.File), func() { serving.Store(&good) }, "not signed by a trusted CA"
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			k, keys, admit, cause := c.setup(t)
			e := newEnvWith(t, k, e2eTopics...)
			addr := freeAddr(t)
			cfg := e.config(withKafka(e2eConfig, keys) + fmt.Sprintf("metrics: {listen: %q}\n", addr))
			log := zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel))
			a, err := newApp(context.Background(), cfg, log, appOptions{metadataMinAge: 100 * time.Millisecond})
			if err != nil {
				t.Fatalf("hipq did not start: %v", err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- a.run(ctx) }()
			t.Cleanup(func() {
				cancel()
				select {
				case err := <-done:
					if err != nil {
						t.Errorf("app: %v", err)
					}
				case <-time.After(30 * time.Second):
					t.Error("app did not stop within 30s")
				}
				a.close()
			})
			url := "http://" + addr
			broker := "broker " + k.Brokers[0] + ": "
			testutil.Eventually(t, 20*time.Second, func() (bool, string) {
				r := getReady(t, http.DefaultClient, url)
				return r.code == http.StatusServiceUnavailable && strings.Contains(r.Checks["kafka"], broker) &&
					strings.Contains(r.Checks["kafka"], cause), r.body
			}, "/readyz not ready, naming %q and %q", broker, cause)
			if r := getReady(t, http.DefaultClient, url); strings.Contains(r.body, password) {
				t.Errorf("/readyz shows the password: %s", r.body)
			}
			// Retried, with backoff: more connections come, but not in a
			// tight loop (a client without backoff makes thousands a
			// second).
			from, start := k.Accepted(), time.Now()
			testutil.Eventually(t, 30*time.Second, func() (bool, string) {
				n := k.Accepted() - from
				return n >= 8, fmt.Sprintf("%d connections", n)
			}, "hipq's clients to try again")
			if n, took := k.Accepted()-from, time.Since(start); float64(n)/took.Seconds() > 40 {
				t.Errorf("%d connections in %v: retried without backoff", n, took)
			}
			select {
			case err := <-done:
				t.Fatalf("hipq stopped while the broker refused it: %v", err)
			default:
			}
			admit()
			testutil.Eventually(t, 30*time.Second, func() (bool, string) {
				r := getReady(t, http.DefaultClient, url)
				return r.Ready, r.body
			}, "/readyz ready once the broker lets hipq in")
			rctx, rcancel := context.WithCancel(context.Background())
			defer rcancel()
			e.respond(rctx, "requests", "replies", func(string, int) (string, bool) { return "succeeded", true })
			e.produce("jobs", jobReq("after"))
			testutil.Eventually(t, 30*time.Second, func() (bool, string) {
				n := e.countJobs(a, "outcome = 'succeeded'")
				return n == 1, fmt.Sprintf("%d succeeded", n)
			}, "a job to go through without a restart")
		})
	}
}

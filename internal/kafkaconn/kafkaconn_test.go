package kafkaconn_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/hipq/hipq/internal/certtest"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/kafkatest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const password = "s3cret-Pa55word-never-shown"

// Each way hipq meets a broker that demands TLS or SASL, each against a
// kfake that demands it, with a CA the test makes: hipq's clients get in
// and a record goes through, and a client without what the broker
// demands does not.
func TestSecureConnections(t *testing.T) {
	t.Parallel()
	ca := certtest.NewCA(t, "kafka")
	clientCA := certtest.NewCA(t, "clients")
	clientCert := clientCA.Client(t, "hipq")
	trustCA := &tls.Config{RootCAs: ca.Pool(), MinVersion: tls.VersionTLS12}
	withCert := &tls.Config{RootCAs: ca.Pool(), MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{clientCert.TLS}}
	cases := []struct {
		name   string
		secure kafkatest.Secure
		cfg    kafkaconn.Config
	}{
		{"TLS verifying the broker with ca_file",
			kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"127.0.0.1"}), ClientTLS: trustCA},
			kafkaconn.Config{TLS: true, CAFile: ca.File}},
		{"TLS with server_name, the certificate not naming the address dialled",
			kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"kafka.internal"}), ClientTLS: &tls.Config{RootCAs: ca.Pool(), ServerName: "kafka.internal"}},
			kafkaconn.Config{TLS: true, CAFile: ca.File, ServerName: "kafka.internal"}},
		{"mutual TLS",
			kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"127.0.0.1"}, clientCA), ClientTLS: withCert},
			kafkaconn.Config{TLS: true, CAFile: ca.File, CertFile: clientCert.CertFile, KeyFile: clientCert.KeyFile}},
	}
	for _, mech := range []string{"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"} {
		cases = append(cases, struct {
			name   string
			secure kafkatest.Secure
			cfg    kafkaconn.Config
		}{"SASL " + mech + " over TLS",
			kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"127.0.0.1"}), ClientTLS: trustCA, Mechanism: mech,
				Users: []kafkatest.User{{Name: "hipq", Password: password}}},
			kafkaconn.Config{TLS: true, CAFile: ca.File, SASLMechanism: mech, Username: "hipq", Password: password}})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			k := kafkatest.NewSecure(t, c.secure)
			c.cfg.Brokers = k.Brokers
			k.CreateTopics(1, "t")
			roundTrip(t, c.cfg, "t")
		})
	}
}

// roundTrip produces a record and reads it back, both with clients
// built from cfg.
func roundTrip(t *testing.T, cfg kafkaconn.Config, topic string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := kafkaconn.NewClient(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := kafkaconn.Ping(ctx, p); err != nil {
		t.Fatalf("ping: %v", err)
	}
	if err := p.ProduceSync(ctx, &kgo.Record{Topic: topic, Value: []byte("hello")}).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
	c, err := kafkaconn.NewClient(cfg, zap.NewNop(), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for {
		f := c.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("nothing read back: %v", f.Errors())
		}
		if recs := f.Records(); len(recs) > 0 {
			if string(recs[0].Value) != "hello" {
				t.Fatalf("read %q, want hello", recs[0].Value)
			}
			return
		}
	}
}

// A client the broker refuses, or that refuses the broker, gets a Ping
// error naming the broker and the cause, and never the password.
func TestRefusedConnectionsNameBrokerAndCause(t *testing.T) {
	t.Parallel()
	ca := certtest.NewCA(t, "kafka")
	other := certtest.NewCA(t, "other")
	clientCA := certtest.NewCA(t, "clients")
	trustCA := &tls.Config{RootCAs: ca.Pool(), MinVersion: tls.VersionTLS12}
	cases := []struct {
		name   string
		secure kafkatest.Secure
		cfg    kafkaconn.Config
		want   string
	}{
		{"a broker certificate no trusted CA signed",
			kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"127.0.0.1"}), ClientTLS: trustCA},
			kafkaconn.Config{TLS: true, CAFile: other.File}, "not signed by a trusted CA"},
		{"a broker certificate for another name",
			kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"kafka.internal"}), ClientTLS: trustCA},
			kafkaconn.Config{TLS: true, CAFile: ca.File}, "not for the name dialled"},
		{"no client certificate where the broker demands one",
			kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"127.0.0.1"}, clientCA), ClientTLS: trustCA},
			kafkaconn.Config{TLS: true, CAFile: ca.File}, "refused the handshake"},
		{"a wrong password",
			kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"127.0.0.1"}), ClientTLS: trustCA, Mechanism: "SCRAM-SHA-512",
				Users: []kafkatest.User{{Name: "hipq", Password: "the-right-one"}}},
			kafkaconn.Config{TLS: true, CAFile: ca.File, SASLMechanism: "SCRAM-SHA-512", Username: "hipq", Password: password},
			"SASL: authentication failed"},
		{"a wrong PLAIN password",
			kafkatest.Secure{ServerTLS: ca.ServerTLS(t, []string{"127.0.0.1"}), ClientTLS: trustCA, Mechanism: "PLAIN",
				Users: []kafkatest.User{{Name: "hipq", Password: "the-right-one"}}},
			kafkaconn.Config{TLS: true, CAFile: ca.File, SASLMechanism: "PLAIN", Username: "hipq", Password: password},
			"SASL: authentication failed"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			k := kafkatest.NewSecure(t, c.secure)
			c.cfg.Brokers = k.Brokers
			cl, err := kafkaconn.NewClient(c.cfg, zap.NewNop())
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err = kafkaconn.Ping(ctx, cl)
			if err == nil {
				t.Fatal("ping passed; want it refused")
			}
			msg := err.Error()
			if want := fmt.Sprintf("broker %s: ", k.Brokers[0]); !strings.Contains(msg, want) || !strings.Contains(msg, c.want) {
				t.Errorf("ping error %q; want it to name %q and %q", msg, want, c.want)
			}
			if strings.Contains(msg, password) {
				t.Errorf("ping error %q shows the password", msg)
			}
		})
	}
}

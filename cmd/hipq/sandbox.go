package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/localpg"
)

// sandbox is the zero-setup environment of demo and bench: an embedded
// Kafka (kfake on a free local port) and $HIPQ_DATABASE_URL or a throwaway
// local PostgreSQL.
type sandbox struct {
	kafka   *kfake.Cluster
	pg      *localpg.Cluster
	dbURL   string
	brokers []string
}

func newSandbox(ctx context.Context, durable bool, partitions int32, topics ...string) (*sandbox, error) {
	return newSandboxWith(ctx, durable, partitions, nil, topics...)
}

// newSandboxWith is newSandbox with PostgreSQL settings for the throwaway
// cluster (unused with $HIPQ_DATABASE_URL).
func newSandboxWith(ctx context.Context, durable bool, partitions int32, pgSettings map[string]string, topics ...string) (*sandbox, error) {
	sb := &sandbox{}
	fake, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topics...))
	if err != nil {
		return nil, fmt.Errorf("start embedded Kafka: %w", err)
	}
	sb.kafka = fake
	sb.brokers = fake.ListenAddrs()
	if u := os.Getenv("HIPQ_DATABASE_URL"); u != "" {
		sb.dbURL = u
		return sb, nil
	}
	pg, err := localpg.Start(ctx, localpg.Options{Durable: durable, Settings: pgSettings})
	if err != nil {
		fake.Close()
		return nil, fmt.Errorf("start a throwaway PostgreSQL: %w", err)
	}
	sb.pg = pg
	sb.dbURL = pg.URL("postgres")
	return sb, nil
}

func (sb *sandbox) close() {
	if sb.pg != nil {
		sb.pg.Stop()
	}
	sb.kafka.Close()
}

func (sb *sandbox) dbDescription() string {
	if sb.pg != nil {
		return "throwaway local PostgreSQL in " + sb.pg.Dir
	}
	return "$HIPQ_DATABASE_URL"
}

// sandboxConfig is the config of demo and bench, parsed like any file.
func (sb *sandbox) config(yaml string, schema string) (*config.Config, error) {
	text := strings.NewReplacer("BROKERS", strings.Join(sb.brokers, ","), "SCHEMA", schema).Replace(yaml)
	env := map[string]string{"DB": sb.dbURL}
	return config.Parse(text, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
}

// newApp builds hipq from the sandbox config text in a schema of its own,
// logging at level to stderr. done closes it and, on a shared database,
// drops the schema.
func (sb *sandbox) newApp(ctx context.Context, yaml, schemaPrefix, level string) (a *app, done func(), err error) {
	schema := fmt.Sprintf("%s_%d", schemaPrefix, time.Now().UnixNano())
	cfg, err := sb.config(yaml, schema)
	if err != nil {
		return nil, nil, err
	}
	log := newLogger(level, "console", os.Stderr)
	a, err = newApp(ctx, cfg, log, appOptions{metadataMinAge: 200 * time.Millisecond})
	if err != nil {
		return nil, nil, err
	}
	return a, func() {
		if sb.pg == nil {
			_ = a.st.DropSchema(context.Background())
		}
		a.close()
	}, nil
}

// responder answers requests like a downstream service would: it copies
// the hipq-* headers onto its reply, so hipq needs no matcher.
type responder struct {
	cl     *kgo.Client
	reply  string
	decide func(key string, attempt int) (status string, answer bool)
	// delay, when set, says how long to wait before replying (replies
	// wait concurrently).
	delay func() time.Duration
}

// newResponder's opts are what its client needs besides (TLS, SASL).
func newResponder(brokers []string, group, requests, replies string,
	decide func(key string, attempt int) (string, bool), opts ...kgo.Opt) (*responder, error) {
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...), kgo.ConsumerGroup(group), kgo.ConsumeTopics(requests),
		kgo.FetchMaxWait(100 * time.Millisecond), kgo.ProducerLinger(2 * time.Millisecond)}, opts...)...)
	if err != nil {
		return nil, err
	}
	return &responder{cl: cl, reply: replies, decide: decide}, nil
}

func (r *responder) run(ctx context.Context) {
	defer r.cl.Close()
	for ctx.Err() == nil {
		fetches := r.cl.PollFetches(ctx)
		fetches.EachRecord(func(rec *kgo.Record) {
			var attempt int
			var headers []kgo.RecordHeader
			for _, h := range rec.Headers {
				if h.Key == correlator.HeaderAttempt {
					attempt, _ = strconv.Atoi(string(h.Value))
				}
				if strings.HasPrefix(h.Key, "hipq-") {
					headers = append(headers, h)
				}
			}
			status, answer := r.decide(string(rec.Key), attempt)
			if !answer {
				return
			}
			value := fmt.Sprintf(`{"status":%q,"echo":%s}`, status, rec.Value)
			if status == "failed" {
				value = fmt.Sprintf(`{"status":"failed","error":"downstream said no (attempt %d)"}`, attempt)
			}
			out := &kgo.Record{Topic: r.reply, Key: rec.Key, Value: []byte(value), Headers: headers}
			if r.delay != nil {
				time.AfterFunc(r.delay(), func() { r.cl.Produce(ctx, out, nil) })
				return
			}
			r.cl.Produce(ctx, out, nil)
		})
	}
}

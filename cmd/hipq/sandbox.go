package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/localcitus"
	"github.com/hipq/hipq/internal/localpg"
	"github.com/hipq/hipq/store"
)

// sandbox is the zero-setup environment of demo and bench: an embedded
// Kafka (kfake on a free local port) and $HIPQ_DATABASE_URL, a throwaway
// local PostgreSQL, or a throwaway local Citus cluster.
type sandbox struct {
	kafka   *kfake.Cluster
	pg      *localpg.Cluster
	citus   *localcitus.Cluster
	dbURL   string
	brokers []string
}

// sandboxDB is the throwaway database a sandbox starts when
// $HIPQ_DATABASE_URL is not set.
type sandboxDB struct {
	// durable keeps fsync on.
	durable bool
	// settings are PostgreSQL settings, of every node.
	settings map[string]string
	// citusWorkers, when positive, makes it a Citus cluster: a
	// coordinator and this many workers.
	citusWorkers int
}

// sandboxDatabase is the database a throwaway Citus cluster makes (a
// Citus cluster is per database: its extension and nodes).
const sandboxDatabase = "hipq"

func newSandbox(ctx context.Context, durable bool, partitions int32, topics ...string) (*sandbox, error) {
	return newSandboxWith(ctx, sandboxDB{durable: durable}, partitions, topics...)
}

// newSandboxWith is newSandbox with the throwaway database described (it
// is not started with $HIPQ_DATABASE_URL, which a Citus cluster refuses).
func newSandboxWith(ctx context.Context, db sandboxDB, partitions int32, topics ...string) (*sandbox, error) {
	if db.citusWorkers > 0 && os.Getenv("HIPQ_DATABASE_URL") != "" {
		return nil, errCitusWithURL
	}
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
	if db.citusWorkers > 0 {
		c, err := localcitus.Start(ctx, db.citusWorkers, localcitus.Options{Durable: db.durable, Settings: db.settings})
		if err == nil {
			sb.citus = c
			sb.dbURL, err = c.NewDatabase(ctx, sandboxDatabase, "")
		}
		if err != nil {
			sb.close()
			if errors.Is(err, localcitus.ErrNoCitus) {
				return nil, fmt.Errorf("--citus-workers starts a local Citus cluster, but %v: install Citus for this PostgreSQL from Citus's own packages "+
					"(https://docs.citusdata.com/en/stable/installation/), or set $HIPQ_DATABASE_URL to a Citus coordinator and drop --citus-workers", err)
			}
			return nil, fmt.Errorf("start a throwaway Citus cluster: %w", err)
		}
		return sb, nil
	}
	pg, err := localpg.Start(ctx, localpg.Options{Durable: db.durable, Settings: db.settings})
	if err != nil {
		fake.Close()
		return nil, fmt.Errorf("start a throwaway PostgreSQL: %w", err)
	}
	sb.pg = pg
	sb.dbURL = pg.URL("postgres")
	return sb, nil
}

// errCitusWithURL: $HIPQ_DATABASE_URL names the database to use, and
// --citus-workers asks for a cluster of the bench's own.
var errCitusWithURL = &exitError{2, errors.New("--citus-workers starts a Citus cluster of its own, but $HIPQ_DATABASE_URL names the database to use: " +
	"unset it, or drop --citus-workers to run on the cluster it names (a Citus coordinator's URL runs the bench on that cluster)")}

func (sb *sandbox) close() {
	if sb.pg != nil {
		sb.pg.Stop()
	}
	if sb.citus != nil {
		sb.citus.Stop()
	}
	sb.kafka.Close()
}

// throwaway says whether the database is the sandbox's own, gone with it.
func (sb *sandbox) throwaway() bool { return sb.pg != nil || sb.citus != nil }

func (sb *sandbox) dbDescription() string {
	switch {
	case sb.pg != nil:
		return "throwaway local PostgreSQL in " + sb.pg.Dir
	case sb.citus != nil:
		return fmt.Sprintf("Citus: a coordinator and %d workers, throwaway local PostgreSQL servers (the coordinator in %s)",
			sb.citus.Workers(), sb.citus.Nodes[0].Dir)
	}
	return "$HIPQ_DATABASE_URL"
}

// sandboxNode is one PostgreSQL server of the sandbox's database.
type sandboxNode struct {
	name, url string
}

// nodes are the servers of a throwaway Citus cluster, the coordinator
// first, with the URLs of the sandbox's database on each; none otherwise.
func (sb *sandbox) nodes() []sandboxNode {
	if sb.citus == nil {
		return nil
	}
	out := []sandboxNode{{"coordinator", sb.dbURL}}
	for i, u := range sb.citus.WorkerURLs(sandboxDatabase) {
		out = append(out, sandboxNode{fmt.Sprintf("worker %d", i+1), u})
	}
	return out
}

// queueNodeURL returns the URL, among nodes, of the node that holds
// queue's shard of hipq_job.
func queueNodeURL(ctx context.Context, st *store.Store, nodes []sandboxNode, queue string) (string, error) {
	var port int
	if err := st.Pool().QueryRow(ctx, `SELECT nodeport FROM citus_shards
		WHERE shardid = get_shard_id_for_distribution_column('hipq_job', $1::text)`, queue).Scan(&port); err != nil {
		return "", fmt.Errorf("find the worker of queue %s: %w", queue, err)
	}
	for _, n := range nodes {
		if c, err := pgx.ParseConfig(n.url); err == nil && int(c.Port) == port {
			return n.url, nil
		}
	}
	return "", fmt.Errorf("queue %s's shard is on port %d, which is none of the cluster's nodes", queue, port)
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
		if !sb.throwaway() {
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

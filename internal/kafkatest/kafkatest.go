// Package kafkatest gives tests a Kafka cluster reached over TCP through the
// same client code a real broker gets: franz-go's kfake, the cluster at
// HIPQ_TEST_KAFKA_BROKERS when set, or, with HIPQ_TEST_DOCKER=1 and the
// tests built with -tags docker, one testcontainers Kafka per test binary
// (tests skip, saying why, when Docker is not there). On a shared cluster
// topics get unique names.
package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Cluster is a test's Kafka.
type Cluster struct {
	Brokers []string
	fake    *kfake.Cluster
	prefix  string
	t       testing.TB
	// opts are what the test's own clients need to get in (TLS, SASL).
	opts []kgo.Opt
	// accepted counts the connections of a NewSecure cluster.
	accepted *atomic.Int64
}

var seq atomic.Int64

// startContainer starts a Kafka container; docker.go sets it in builds with
// -tags docker.
var startContainer func(context.Context) ([]string, error)

var errNoDocker = errors.New("no Docker engine is reachable")

var (
	containerOnce    sync.Once
	containerBrokers []string
	containerErr     error
)

// New starts (or reaches) a cluster for t, closed when t ends. fakeOpts
// tune a kfake cluster (a real one is taken as it is).
func New(t testing.TB, fakeOpts ...kfake.Opt) *Cluster {
	t.Helper()
	c := &Cluster{t: t}
	if b := os.Getenv("HIPQ_TEST_KAFKA_BROKERS"); b != "" {
		c.Brokers = strings.Split(b, ",")
		c.prefix = fmt.Sprintf("hipqtest-%d-%d-", os.Getpid(), seq.Add(1))
		return c
	}
	if os.Getenv("HIPQ_TEST_DOCKER") == "1" {
		if startContainer == nil {
			t.Skip("HIPQ_TEST_DOCKER=1 asks for a Kafka container: build the tests with -tags docker")
		}
		containerOnce.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			containerBrokers, containerErr = startContainer(ctx)
		})
		if errors.Is(containerErr, errNoDocker) {
			t.Skip("HIPQ_TEST_DOCKER=1 asks for a Kafka container, but " + containerErr.Error())
		}
		if containerErr != nil {
			t.Fatalf("Kafka container: %v", containerErr)
		}
		c.Brokers = containerBrokers
		c.prefix = fmt.Sprintf("hipqtest-%d-%d-", os.Getpid(), seq.Add(1))
		return c
	}
	fake, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(1)}, fakeOpts...)...)
	if err != nil {
		t.Fatalf("start kfake: %v", err)
	}
	t.Cleanup(fake.Close)
	c.fake = fake
	c.Brokers = fake.ListenAddrs()
	return c
}

// Fake is the kfake cluster, nil against a real one.
func (c *Cluster) Fake() *kfake.Cluster { return c.fake }

// Topic returns the test's name for topic.
func (c *Cluster) Topic(name string) string { return c.prefix + name }

// CreateTopics creates topics (by their test names) with partitions each.
func (c *Cluster) CreateTopics(partitions int32, names ...string) {
	c.t.Helper()
	cl := c.Client()
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := kadm.NewClient(cl).CreateTopics(ctx, partitions, 1, nil, names...)
	if err != nil {
		c.t.Fatalf("create topics: %v", err)
	}
	for _, r := range resp {
		if r.Err != nil && !strings.Contains(r.Err.Error(), "TOPIC_ALREADY_EXISTS") {
			c.t.Fatalf("create topic %s: %v", r.Topic, r.Err)
		}
	}
}

// Client is a plain client for producing and reading in tests.
func (c *Cluster) Client(opts ...kgo.Opt) *kgo.Client {
	c.t.Helper()
	cl, err := kgo.NewClient(append(c.ClientOpts(kgo.SeedBrokers(c.Brokers...), kgo.MetadataMinAge(100*time.Millisecond)), opts...)...)
	if err != nil {
		c.t.Fatalf("kafka client: %v", err)
	}
	return cl
}

// Produce writes records synchronously.
func (c *Cluster) Produce(rs ...*kgo.Record) {
	c.t.Helper()
	cl := c.Client()
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, rs...).FirstErr(); err != nil {
		c.t.Fatalf("produce: %v", err)
	}
}

// ClientOpts are opts plus what a client of the test's own needs to get
// into the cluster: on a secured cluster, TLS and the superuser's SASL.
func (c *Cluster) ClientOpts(opts ...kgo.Opt) []kgo.Opt {
	return append(opts, c.opts...)
}

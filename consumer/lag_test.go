package consumer

import (
	"context"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// hipq_consumer_lag_records is the end offset minus the next offset to
// apply of each partition assigned here, read at scrape time (a partition
// with no stored offset counts from its start); it falls as records are
// applied.
func TestLagMetric(t *testing.T) {
	t.Parallel()
	k := kafkatest.New(t)
	topic := k.Topic("lag")
	k.CreateTopics(2, topic)
	var recs []*kgo.Record
	for i := range 5 {
		recs = append(recs, &kgo.Record{Topic: topic, Partition: int32(i % 2), Value: []byte("x")})
	}
	cl := k.Client(kgo.RecordPartitioner(kgo.ManualPartitioner()))
	defer cl.Close()
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	m := metrics.New()
	g, err := newGroup(zaptest.NewLogger(t), pgtest.New(t), GroupConfig{Kafka: kafkaconn.Config{Brokers: k.Brokers}, Group: topic + "-g",
		Topics: []string{topic}, Metrics: m}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.cl.Close()
	lag := func() (p0, p1 float64) {
		t.Helper()
		var ok0, ok1 bool
		p0, ok0 = m.Value("hipq_consumer_lag_records", map[string]string{"group": topic + "-g", "topic": topic, "partition": "0"})
		p1, ok1 = m.Value("hipq_consumer_lag_records", map[string]string{"group": topic + "-g", "topic": topic, "partition": "1"})
		if !ok0 || !ok1 {
			t.Fatalf("lag not reported for both partitions: %v %v", ok0, ok1)
		}
		return p0, p1
	}
	// Once both partitions are assigned (nothing stored: counted from the
	// start), partition 1 is taken as applied up to offset 1.
	testutil.Eventually(t, 20*time.Second, func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.pos) == 2
	}, "both partitions to be assigned")
	g.mu.Lock()
	g.pos[store.TopicPartition{Topic: topic, Partition: 1}] = 1
	g.mu.Unlock()
	if p0, p1 := lag(); p0 != 3 || p1 != 1 {
		t.Fatalf("lag %v %v, want 3 1", p0, p1)
	}
	g.mu.Lock()
	g.pos[store.TopicPartition{Topic: topic, Partition: 0}] = 3
	g.pos[store.TopicPartition{Topic: topic, Partition: 1}] = 2
	g.mu.Unlock()
	if p0, p1 := lag(); p0 != 0 || p1 != 0 {
		t.Fatalf("lag %v %v once applied, want 0 0", p0, p1)
	}
	// A partition taken away is no longer reported here.
	g.forget(context.Background(), nil, map[string][]int32{topic: {1}})
	if n := promtestutil.CollectAndCount(m.Registry(), "hipq_consumer_lag_records"); n != 1 {
		t.Fatalf("%d lag series after a revocation, want 1", n)
	}
}

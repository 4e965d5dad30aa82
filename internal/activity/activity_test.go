package activity

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// Sends count by queue (result sent only), replies by their type's queue;
// each write adds what is new since the last one, never a total twice.
func TestRecorderWritesDeltas(t *testing.T) {
	ctx := context.Background()
	st := pgtest.New(t)
	m := metrics.New()
	types := correlator.Types{"a": {Name: "a", Queue: "qa"}, "b": {Name: "b", Queue: "qb"}}
	r := New(zap.NewNop(), st, m, "i1", types, time.Hour)
	m.Dispatches.WithLabelValues("qa", "kafka", "sent").Add(3)
	m.Dispatches.WithLabelValues("qa", "kafka", "refused").Add(5)
	m.ObserveReplies("kafka", nil, []correlator.RoundTrip{{JobType: "a"}, {JobType: "b"}, {JobType: "b"}, {JobType: "gone"}})
	r.write(ctx)
	m.Dispatches.WithLabelValues("qa", "http", "sent").Add(1)
	r.write(ctx)
	r.write(ctx) // nothing new
	got, err := st.ActivitySince(ctx, time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	sum := map[string][2]int64{}
	for _, a := range got {
		v := sum[a.Queue]
		sum[a.Queue] = [2]int64{v[0] + a.Dispatched, v[1] + a.Replied}
	}
	if sum["qa"] != [2]int64{4, 1} || sum["qb"] != [2]int64{0, 2} || len(sum) != 2 {
		t.Fatalf("activity: %v", sum)
	}
}

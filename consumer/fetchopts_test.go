package consumer

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/internal/kafkaconn"
)

// A group's client fetches and buffers within the bounds its config sets,
// and keeps franz-go's defaults where it sets none.
func TestGroupFetchBounds(t *testing.T) {
	t.Parallel()
	build := func(cfg GroupConfig) *kgo.Client {
		t.Helper()
		// No broker listens there: the client is only built, and closed.
		cfg.Kafka, cfg.Group, cfg.Topics = kafkaconn.Config{Brokers: []string{"127.0.0.1:1"}}, "g", []string{"t"}
		g, err := newGroup(zap.NewNop(), nil, cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(g.cl.Close)
		return g.cl
	}
	cl := build(GroupConfig{FetchMaxBytes: 256 << 10, FetchMaxPartitionBytes: 128 << 10, MaxConcurrentFetches: 4, MaxBufferedBytes: 3 << 20,
		MaxDecompressBatchBytes: 16 << 20})
	for _, c := range []struct {
		name string
		opt  any
		want any
	}{
		{"FetchMaxBytes", kgo.FetchMaxBytes, int32(256 << 10)},
		{"FetchMaxPartitionBytes", kgo.FetchMaxPartitionBytes, int32(128 << 10)},
		{"MaxConcurrentFetches", kgo.MaxConcurrentFetches, 4},
		{"MaxBufferedBytes", kgo.MaxBufferedBytes, int64(3 << 20)},
		{"MaxDecompressBatchBytes", kgo.MaxDecompressBatchBytes, 16 << 20},
	} {
		if got := cl.OptValue(c.opt); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
	def := build(GroupConfig{})
	if got := def.OptValue(kgo.FetchMaxBytes); got != int32(50<<20) {
		t.Errorf("FetchMaxBytes unset: %v, want franz-go's 50 MiB", got)
	}
	if got := def.OptValue(kgo.MaxDecompressBatchBytes); got != 1<<30 {
		t.Errorf("MaxDecompressBatchBytes unset: %v, want franz-go's 1 GiB", got)
	}
	if got := def.OptValue(kgo.MaxBufferedBytes); got != int64(0) {
		t.Errorf("MaxBufferedBytes unset: %v, want unbounded (0)", got)
	}
}

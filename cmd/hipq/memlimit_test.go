package main

import (
	"context"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/internal/memlimit"
)

// The memory limit's split reaches every client that follows a burst:
// both consumer groups' fetches and buffers, the requests' producer and a
// job type's own-compression producer; the limit is served as
// hipq_memory_limit_bytes.
func TestMemorySplitWired(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	text := e2eConfig + `
  - name: e2e.zstd
    transport: {kafka: {topic: "{{T:requests}}", compression: zstd}}
    reply_topic: "{{T:replies}}"
`
	const limit = 256 << 20
	a, err := newApp(context.Background(), e.config(text), nopLogger(), appOptions{roles: []string{"intake", "dispatcher", "responses"}, memoryLimit: limit})
	if err != nil {
		t.Fatal(err)
	}
	// Run, so that stopping it closes the groups' clients.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.run(ctx) }()
	defer func() { cancel(); _ = <-done; a.close() }()
	// 256 MiB: fetches of 1 MiB, four at once per group; a 32 MiB eighth
	// for the producers, among four clients that write (the requests'
	// producer, the zstd producer, the two groups); a batch decompressed
	// to 64 MiB at most.
	g := a.group("g", []string{"t"}, "")
	if g.FetchMaxBytes != 1<<20 || g.FetchMaxPartitionBytes != 1<<20 || g.MaxConcurrentFetches != 4 || g.MaxBufferedBytes != 8<<20 ||
		g.MaxDecompressBatchBytes != 64<<20 {
		t.Errorf("a group's bounds: %d a fetch, %d a partition, %d fetches, %d buffered, %d a batch decompressed; want 1 MiB, 1 MiB, 4, 8 MiB, 64 MiB",
			g.FetchMaxBytes, g.FetchMaxPartitionBytes, g.MaxConcurrentFetches, g.MaxBufferedBytes, g.MaxDecompressBatchBytes)
	}
	if len(a.producers) != 1 {
		t.Fatalf("%d producers of their own compression, want 1", len(a.producers))
	}
	for i, p := range append([]*kgo.Client{a.producer}, a.producers...) {
		if got := p.OptValue(kgo.MaxBufferedBytes); got != int64(8<<20) {
			t.Errorf("producer %d buffers %v bytes, want 8 MiB", i, got)
		}
	}
	if got := scrape(t, a.metrics.Handler())["hipq_memory_limit_bytes"]; got != limit {
		t.Errorf("hipq_memory_limit_bytes %v, want %d", got, limit)
	}
	// Below the largest record, a client's buffer is the largest record:
	// a smaller one would refuse it.
	big := e.config(strings.Replace(e2eConfig, "session_timeout: 6s", "session_timeout: 6s, max_record_bytes: 2000000", 1))
	if _, each := memorySplit(big, memlimit.Min); each != 2000000 {
		t.Errorf("each writer's buffer at the minimum: %d, want kafka.max_record_bytes (2000000)", each)
	}
}

// hipq run applies the limit to the runtime, less the binary's resident
// pages, and logs it with where it came from; an explicit limit above 90%
// of the cgroup's is lowered to it, with a warning. Not parallel: the
// runtime's limit is the process's.
func TestMemoryLimitApplied(t *testing.T) {
	prev, prevGC := debug.SetMemoryLimit(-1), debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetMemoryLimit(prev); debug.SetGCPercent(prevGC) })
	root := t.TempDir()
	for name, text := range map[string]string{
		"proc/self/cgroup":         "0::/\n",
		"proc/self/status":         "RssFile:\t27648 kB\n", // 27 MiB
		"sys/fs/cgroup/memory.max": "536870912\n",          // 512 MiB
	} {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	env := memlimit.Env{Root: root, Lookup: func(string) (string, bool) { return "", false }}
	conf := func(line string) *config.Config {
		t.Helper()
		cfg, err := config.Parse("database: {url: x}\nkafka: {brokers: [b]}\n"+line+"\n", nil)
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	for _, c := range []struct {
		name, config string
		want         int64
		from         string
		warned       bool
	}{
		{"memory_limit", "memory_limit: 128MiB", 128 << 20, "memory_limit", false},
		{"the cgroup's", "", 536870912 / 100 * 90, "90% of the cgroup's limit (/sys/fs/cgroup/memory.max: 512MiB)", false},
		{"memory_limit above the cgroup's", "memory_limit: 1GiB", 536870912 / 100 * 90, "memory_limit", true},
	} {
		core, logs := observer.New(zapcore.InfoLevel)
		ctx, cancel := context.WithCancel(context.Background())
		got, err := applyMemoryLimit(ctx, conf(c.config), zap.New(core), env)
		cancel()
		if err != nil || got != c.want {
			t.Errorf("%s: %d, %v; want %d", c.name, got, err, c.want)
			continue
		}
		if rt := debug.SetMemoryLimit(-1); rt != c.want-27<<20 {
			t.Errorf("%s: the runtime's limit %d, want the limit less 27 MiB, %d", c.name, rt, c.want-27<<20)
		}
		if gc := debug.SetGCPercent(100); gc != memlimit.GCPercent {
			t.Errorf("%s: the collector's pace %d, want %d", c.name, gc, memlimit.GCPercent)
		}
		info := logs.FilterMessage("memory limit").All()
		if len(info) != 1 || info[0].ContextMap()["from"] != c.from || info[0].ContextMap()["bytes"] != c.want ||
			info[0].ContextMap()["gc_percent"] != int64(memlimit.GCPercent) {
			t.Errorf("%s: logged %v, want one line from %q", c.name, info, c.from)
		}
		if warned := logs.FilterLevelExact(zapcore.WarnLevel).Len() == 1; warned != c.warned {
			t.Errorf("%s: warned %v, want %v", c.name, warned, c.warned)
		}
	}
	// GOGC set: the runtime read it, and it stands.
	debug.SetGCPercent(250)
	own := memlimit.Env{Root: root, Lookup: func(k string) (string, bool) { return "250", k == "GOGC" }}
	ctx, cancel := context.WithCancel(context.Background())
	_, err := applyMemoryLimit(ctx, conf(""), zap.NewNop(), own)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	if gc := debug.SetGCPercent(100); gc != 250 {
		t.Errorf("with GOGC=250 the collector's pace is %d, want 250", gc)
	}
	bad := memlimit.Env{Root: root, Lookup: func(k string) (string, bool) { return "lots", k == "GOMEMLIMIT" }}
	if _, err := applyMemoryLimit(context.Background(), conf(""), zap.NewNop(), bad); err == nil || !strings.Contains(err.Error(), "GOMEMLIMIT") {
		t.Errorf("a bad GOMEMLIMIT: %v, want an error naming it", err)
	}
}

// The outcome events' relay writes with a producer of its own, counted
// among the writers: events a topic holds back fill only its buffer, never
// the one the requests are sent from.
func TestRelayHasAProducerOfItsOwn(t *testing.T) {
	t.Parallel()
	e := newEnv(t, eventsTopics...)
	const limit = 256 << 20
	a, err := newApp(context.Background(), e.config(eventsConfig()), nopLogger(), appOptions{roles: []string{"dispatcher"}, memoryLimit: limit})
	if err != nil {
		t.Fatal(err)
	}
	defer a.close()
	if a.relay == nil || a.relay.Client() == a.producer {
		t.Fatal("the relay writes with the requests' producer")
	}
	// 32 MiB for the producers among four writers: the requests', the
	// relay's and the two groups' (no type has a codec of its own).
	for i, p := range []*kgo.Client{a.producer, a.relay.Client()} {
		if got := p.OptValue(kgo.MaxBufferedBytes); got != int64(8<<20) {
			t.Errorf("producer %d buffers %v bytes, want 8 MiB", i, got)
		}
	}
}

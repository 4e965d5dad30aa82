package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/internal/testutil"
)

// Issue 16: hipq writes what any Kafka client can read: no compression by
// default (Kafka's producer default; kafkajs reads only none and gzip
// without extra codecs), requests and dead-letter copies alike; a job type
// may choose its own codec.
func TestCompressionKafkasWay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, append(e2eTopics, "gz")...)
	cfg := e.config(strings.Replace(e2eConfig, "job_types:", `job_types:
  - name: zipped
    transport: {kafka: {topic: "{{T:gz}}", compression: gzip}}
    timeout: 2s`, 1))
	a := e.start(cfg, "intake", "dispatcher")
	// Compressible data: franz-go writes a batch that would not shrink uncompressed.
	data := `"` + strings.Repeat("a", 1500) + `"`
	e.produce("jobs", `{"job_type":"e2e","job_key":"plain","job_data":`+data+`}`, `{"job_type":"zipped","job_key":"z","job_data":`+data+`}`,
		`not json `+strings.Repeat("b", 1500))
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		n := e.countJobs(a, "state = 'running'")
		return n == 2, fmt.Sprintf("%d running", n)
	}, "both jobs sent")
	codec := func(topic string) int8 {
		cl := e.kafka.Client(kgo.ConsumeTopics(e.kafka.Topic(topic)), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
		defer cl.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		for ctx.Err() == nil {
			if recs := cl.PollFetches(ctx).Records(); len(recs) > 0 {
				return int8(recs[0].Attrs.CompressionType())
			}
		}
		t.Fatalf("nothing on %s", topic)
		return -1
	}
	for topic, want := range map[string]int8{"requests": 0, "jobs.dlq": 0, "gz": 1} {
		if got := codec(topic); got != want {
			t.Errorf("%s: compression type %d, want %d (0 none, 1 gzip)", topic, got, want)
		}
	}
	if _, err := config.Parse(strings.Replace(e.configText(e2eConfig), "session_timeout: 6s", "session_timeout: 6s, compression: brotli", 1), nil); err == nil ||
		!strings.Contains(err.Error(), `kafka.compression: "brotli" is not one of`) {
		t.Fatalf("an unknown compression: %v", err)
	}
}

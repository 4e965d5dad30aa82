package deadletter_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/store"
)

// Copy never waits for room: with its client's buffer full of copies a
// topic does not take (here, no broker answers at all), the copies it has
// no room for are logged and dropped (PostgreSQL keeps the dead letters),
// and the consumer that copies goes on.
func TestCopyNeverWaitsForRoom(t *testing.T) {
	cl, err := kgo.NewClient(kgo.SeedBrokers("127.0.0.1:1"), kgo.MaxBufferedBytes(16<<10),
		kgo.RecordDeliveryTimeout(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	c := &deadletter.Copier{Client: cl, Topic: "dl", Log: zap.NewNop()} // (the copies dropped are logged after the test, as Close fails them)
	dls := make([]store.DeadLetter, 40)
	for i := range dls {
		dls[i] = store.DeadLetter{Kind: store.SourceIntake, Reason: "bad", Source: store.Source{Value: bytes.Repeat([]byte("x"), 1<<10)}}
	}
	done := make(chan struct{})
	go func() { c.Copy(dls); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("Copy waited for room in a buffer that never empties")
	}
}

// A dead letter without a value (a producer's tombstone, a batch too
// large to read) is copied with an empty value, not as a tombstone: a
// compacted dead-letter topic would take a tombstone for the deletion of
// the copies of its key before it.
func TestCopyIsNeverATombstone(t *testing.T) {
	kc := kafkatest.New(t)
	topic := kc.Topic("dl")
	kc.CreateTopics(1, topic)
	cl := kc.Client()
	defer cl.Close()
	c := &deadletter.Copier{Client: cl, Topic: topic, Log: zap.NewNop()}
	c.Copy([]store.DeadLetter{
		{Kind: store.SourceIntake, Reason: "malformed: a tombstone", Source: store.Source{Key: []byte("k1")}},
		{Kind: store.SourceIntake, Reason: "too_large: offsets 5 to 9", Source: store.Source{}},
		{Kind: store.SourceIntake, Reason: "malformed: not JSON", Source: store.Source{Key: []byte("k1"), Value: []byte("x")}},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	rd := kc.Client(kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer rd.Close()
	var got []*kgo.Record
	for len(got) < 3 && ctx.Err() == nil {
		got = append(got, rd.PollFetches(ctx).Records()...)
	}
	if len(got) != 3 {
		t.Fatalf("read %d copies, want 3", len(got))
	}
	for i, want := range []string{"", "", "x"} {
		if got[i].Value == nil || string(got[i].Value) != want {
			t.Errorf("copy %d: value %q (nil: %v), want %q, not a tombstone", i, got[i].Value, got[i].Value == nil, want)
		}
	}
}

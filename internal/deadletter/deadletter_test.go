package deadletter_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/internal/deadletter"
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

package dispatcher_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// inDoubt answers every send as one that may have reached its service
// (a produce cut off with the record in flight), counting them.
type inDoubt struct{ sends atomic.Int64 }

func (s *inDoubt) Transport() string             { return "stub" }
func (s *inDoubt) Route(string) dispatcher.Route { return dispatcher.Route{Neighbour: "stub"} }
func (s *inDoubt) Send(_ context.Context, jobs []store.Claimed) []dispatcher.Result {
	s.sends.Add(int64(len(jobs)))
	out := make([]dispatcher.Result, len(jobs))
	for i := range out {
		out[i] = dispatcher.Result{Status: dispatcher.Unknown, Err: errors.New("produce: context deadline exceeded")}
	}
	return out
}

// A rate limit counts every request that may have left: a send in doubt
// of an at_least_once type is undone to be sent again, and the re-send
// waits for the window (limit 1 an hour: one request in the hour, not
// two).
func TestRateCountsSendsInDoubt(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	rate, err := correlator.NewRate("q:default#0", 1, time.Hour, "", "")
	if err != nil {
		t.Fatal(err)
	}
	s := &inDoubt{}
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 100,
		Queues: []dispatcher.QueueConfig{{Name: "default", Throttle: correlator.Throttle{Rates: []correlator.Rate{rate}}}},
		Types:  types(), Senders: map[string]dispatcher.Sender{"alo": s}})
	insert(t, st, "alo", 1)
	for round := range 3 {
		if _, err := d.RunOnce(ctx); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
	}
	if n := s.sends.Load(); n != 1 {
		t.Fatalf("%d requests sent within the hour, limit 1", n)
	}
	if n := scalar(t, st, `SELECT count(*) FROM hipq_job WHERE state = 'initial' AND attempt = 0`); n != 1 {
		t.Fatalf("the job in doubt is not waiting to be sent again (%d waiting)", n)
	}
}

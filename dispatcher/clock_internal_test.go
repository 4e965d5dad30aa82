package dispatcher

import (
	"errors"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

// Issue 9.5: a retry is scheduled on PostgreSQL's clock (its clock at the
// claim plus the monotonic time since), never this host's: with the two
// 60 s apart either way, the next run is the backoff after PostgreSQL's now.
func TestRetryScheduledOnTheDatabaseClock(t *testing.T) {
	jt := &correlator.JobType{Name: "t", Retry: &correlator.Backoff{Attempts: 3, Initial: time.Hour,
		When: []correlator.AttemptOutcome{correlator.AttemptDispatchError}}}
	for _, skew := range []time.Duration{-time.Minute, time.Minute} {
		local := time.Now()
		c := &store.Claimed{ID: 1, Attempt: 1, MaxAttempts: 3, StartedAt: local.Add(skew), ClaimedLocal: local}
		r := dispatchError(c, jt, Result{Err: errors.New("HTTP 503")}, true, true)
		if r.Res.State != correlator.StateRetry {
			t.Fatalf("state %s", r.Res.State)
		}
		if got := r.Res.NextRun.Sub(local.Add(skew)); got < time.Hour || got > time.Hour+time.Second {
			t.Fatalf("skew %v: next run %v after the database's now, want 1h", skew, got)
		}
	}
}

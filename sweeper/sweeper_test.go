package sweeper_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
	"github.com/hipq/hipq/sweeper"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var ctx = context.Background()

// Invariant 8: a claim whose instance died before sending is undone after
// the send timeout plus grace (at_least_once) or ends final / failed
// (at_most_once); a younger one is left alone, even past its job's timeout:
// a request that never left is not timed out (its attempt would be burned
// by an outage of hipq's own). A claim of a type this instance does not
// know is left to its job's timeout (neither its send bound nor whether
// it may be sent again is known here). The rescue works through every
// lost claim in one sweep, a batch at a time. Timeouts, expiry and the
// sweeper lock run in the same sweep.
func TestSweep(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	types := map[string]*correlator.JobType{
		"alo": {Name: "alo", Queue: "default", Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry},
		"amo": {Name: "amo", Queue: "default", Delivery: correlator.AtMostOnce, Retry: correlator.NoRetry},
	}
	past := time.Now().Add(-time.Minute)
	mk := func(typ, key string, expires *time.Time) *correlator.Job {
		return &correlator.Job{Queue: "default", JobType: typ, JobKey: key, JobData: json.RawMessage(`{}`), MaxAttempts: 1,
			Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second), ExpiresAt: expires}
	}
	quick := mk("alo", "quick", nil)
	quick.TimeoutSeconds = 1
	if _, err := st.JobsInsert(ctx, []*correlator.Job{mk("alo", "dead", nil), mk("amo", "dead", nil), mk("alo", "young", nil), mk("alo", "slow", nil),
		mk("alo", "lost", nil), quick, mk("removed", "dead", nil), mk("removed", "old", nil), mk("alo", "lost2", nil)}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 10, Instance: "gone"}); err != nil {
		t.Fatal(err)
	}
	exec := func(q string) {
		if _, err := st.Pool().Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	exec(`UPDATE hipq_attempt a SET dispatched_at = now() - interval '10 minutes' FROM hipq_job j WHERE j.queue = a.queue AND j.id = a.job_id AND j.job_key = 'dead'`)
	exec(`UPDATE hipq_job SET started_at = now() - interval '10 minutes' WHERE job_key = 'dead'`) // (a running job's started_at is its attempt's dispatched_at)
	exec(`UPDATE hipq_job SET started_at = now() - interval '2 hours' WHERE job_key = 'slow'`)
	// Never sent, and past their timeouts: a lost claim past the send bound
	// too (undone, not timed out: the request never left), and one within
	// it (left for the rescue, which decides once the bound has passed).
	exec(`UPDATE hipq_attempt a SET dispatched_at = now() - interval '2 hours' FROM hipq_job j WHERE j.queue = a.queue AND j.id = a.job_id AND j.job_key = 'lost'`)
	exec(`UPDATE hipq_job SET started_at = now() - interval '2 hours' WHERE job_key = 'lost'`)
	exec(`UPDATE hipq_attempt a SET dispatched_at = now() - interval '9 minutes' FROM hipq_job j WHERE j.queue = a.queue AND j.id = a.job_id AND j.job_key = 'lost2'`)
	exec(`UPDATE hipq_job SET started_at = now() - interval '9 minutes' WHERE job_key = 'lost2'`)
	exec(`UPDATE hipq_job SET started_at = now() - interval '2 hours' WHERE job_type = 'removed' AND job_key = 'old'`)
	exec(`UPDATE hipq_attempt a SET dispatched_at = now() - interval '5 seconds' FROM hipq_job j WHERE j.queue = a.queue AND j.id = a.job_id AND j.job_key = 'quick'`)
	exec(`UPDATE hipq_job SET started_at = now() - interval '5 seconds' WHERE job_key = 'quick'`)
	exec(`UPDATE hipq_attempt a SET sent_at = now() FROM hipq_job j WHERE j.queue = a.queue AND j.id = a.job_id AND j.job_key = 'slow'`)
	if _, err := st.JobsInsert(ctx, []*correlator.Job{mk("alo", "expired", &past)}); err != nil {
		t.Fatal(err)
	}
	m := metrics.New()
	sw := sweeper.New(zaptest.NewLogger(t), st, sweeper.Config{Grace: time.Minute, Types: types, Metrics: m, BatchSize: 2})
	release, ok, err := st.SweeperLock(ctx)
	if err != nil || !ok {
		t.Fatalf("lock: %v %v", ok, err)
	}
	if _, ok2, _ := st.SweeperLock(ctx); ok2 {
		t.Fatal("two sweepers hold the lock")
	}
	rep, err := sw.RunOnce(ctx)
	release()
	if err != nil {
		t.Fatal(err)
	}
	want := sweeper.Report{TimedOut: 2, Rescued: 3, FailedUnsent: 1, Expired: 1}
	if rep != want {
		t.Fatalf("report %+v, want %+v", rep, want)
	}
	state := func(typ, key string) (string, string, int) {
		var s, o string
		var a int
		if err := st.Pool().QueryRow(ctx, `SELECT state, coalesce(outcome, ''), attempt FROM hipq_job WHERE job_type = $1 AND job_key = $2`, typ, key).Scan(&s, &o, &a); err != nil {
			t.Fatal(err)
		}
		return s, o, a
	}
	for _, c := range []struct {
		typ, key, state, outcome string
		attempt                  int
	}{
		{"alo", "dead", "initial", "", 0},
		{"amo", "dead", "final", "failed", 1},
		{"removed", "dead", "running", "", 1},
		{"removed", "old", "final", "timed_out", 1},
		{"alo", "lost2", "initial", "", 0},
		{"alo", "young", "running", "", 1},
		{"alo", "slow", "final", "timed_out", 1},
		{"alo", "lost", "initial", "", 0},
		{"alo", "quick", "running", "", 1},
		{"alo", "expired", "final", "expired", 0},
	} {
		if s, o, a := state(c.typ, c.key); s != c.state || o != c.outcome || a != c.attempt {
			t.Errorf("%s/%s: %s %q %d, want %s %q %d", c.typ, c.key, s, o, a, c.state, c.outcome, c.attempt)
		}
	}
	// Idempotent: a second sweep (or a second sweeper) finds nothing to do.
	if rep, _ := sw.RunOnce(ctx); rep != (sweeper.Report{}) {
		t.Fatalf("second sweep did work: %+v", rep)
	}
	// The metrics count each action once.
	for action, n := range map[string]float64{"timed_out": 2, "rescued": 3, "failed_unsent": 1, "expired": 1, "pruned": 0} {
		if got := testutil.ToFloat64(m.Sweeper.WithLabelValues(action)); got != n {
			t.Errorf("hipq_sweeper_actions_total{action=%q} = %v, want %v", action, got, n)
		}
	}
}

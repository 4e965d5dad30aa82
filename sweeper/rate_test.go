package sweeper_test

import (
	"encoding/json"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
	"github.com/hipq/hipq/sweeper"
)

// The rescue of a claim whose instance died after sending and before
// recording it undoes the claim for a re-send (at_least_once), and its
// request keeps counting in its rate window: limit 1 an hour, no second
// claim within the hour.
func TestRescuedClaimsKeepCounting(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	types := correlator.Types{"alo": {Name: "alo", Queue: "default", Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}
	var jobs []*correlator.Job
	for _, key := range []string{"a", "b"} {
		jobs = append(jobs, &correlator.Job{Queue: "default", JobType: "alo", JobKey: key, JobData: json.RawMessage(`{}`), MaxAttempts: 1,
			Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)})
	}
	if _, err := st.JobsInsert(ctx, jobs); err != nil {
		t.Fatal(err)
	}
	rate, err := correlator.NewRate("q:default#0", 1, time.Hour, "", "")
	if err != nil {
		t.Fatal(err)
	}
	p := store.JobClaimParams{Queue: "default", Limit: 10, Instance: "gone", Throttle: correlator.Throttle{Rates: []correlator.Rate{rate}}}
	if c, err := st.JobClaim(ctx, p); err != nil || len(c.Jobs) != 1 {
		t.Fatalf("claim: %d jobs, %v", len(c.Jobs), err)
	}
	// The claim made 10 minutes ago: its job's start, its attempt's and
	// its rate unit's (which keeps the claim it was made by). (A time of
	// the test's, as Citus refuses to update a distributed table by a
	// stable function of a column, such as a time minus an interval.)
	ago := time.Now().Add(-10 * time.Minute)
	for _, q := range []string{"UPDATE hipq_attempt SET dispatched_at = $1", "UPDATE hipq_job SET started_at = $1 WHERE state = 'running'",
		"UPDATE hipq_rate_unit SET claimed_at = $1"} {
		if _, err := st.Pool().Exec(ctx, q, ago); err != nil {
			t.Fatal(err)
		}
	}
	sw := sweeper.New(zaptest.NewLogger(t), st, sweeper.Config{Grace: time.Minute, Types: types, BatchSize: 10})
	rep, err := sw.RunOnce(ctx)
	if err != nil || rep.Rescued != 1 {
		t.Fatalf("sweep: rescued %d, %v", rep.Rescued, err)
	}
	p.Instance = "next"
	if c, err := st.JobClaim(ctx, p); err != nil || len(c.Jobs) != 0 {
		t.Fatalf("after the rescue a claim took %d jobs within the hour (limit 1): %v", len(c.Jobs), err)
	}
}

package store_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// limitedBatch is an intake batch of partition p whose jobs all ask to be
// claimed in a queue with limits th.
func limitedBatch(p int32, th correlator.Throttle, jobs ...*correlator.Job) store.IntakeBatch {
	b := claimAll(intakeBatch(-1, int64(len(jobs))-1, jobs...))
	for i := range b.Offsets {
		b.Offsets[i].Partition = p
	}
	b.Limits = map[string]store.IntakeLimits{"default": {Throttle: th}}
	return b
}

// Batches stored at once in a queue with a limit claim, all together, no
// more than the limit leaves room for: each takes the queue's claim lock
// and counts what the batches before it claimed. A dispatcher's claim
// after them finds the queue full, and says its due jobs are held.
func TestIntakeClaimsUnderTheQueueLimit(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	st := pgtest.New(t)
	th := correlator.Throttle{Limit: 6}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	claimed := make(chan int, 4)
	for p := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var jobs []*correlator.Job
			for i := range 5 {
				jobs = append(jobs, job(fmt.Sprintf("p%d-%d", p, i)))
			}
			res, err := st.IntakeApply(ctx, limitedBatch(int32(p), th, jobs...))
			errs <- err
			claimed <- len(res.Claimed)
		}()
	}
	wg.Wait()
	close(errs)
	close(claimed)
	total := 0
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	for n := range claimed {
		total += n
	}
	running := count(t, st, `SELECT count(*) FROM hipq_job WHERE state = 'running'`)
	if total != 6 || running != 6 {
		t.Fatalf("%d claimed at intake, %d running; want the limit, 6", total, running)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_attempt`); n != 6 {
		t.Fatalf("%d attempt rows for 6 claims", n)
	}
	c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 100, Instance: "test", Throttle: th})
	if err != nil || len(c.Jobs) != 0 || !c.Held {
		t.Fatalf("claim after the intake: %d jobs, held %v (%v); want none, held", len(c.Jobs), c.Held, err)
	}
}

// The intake's claim in a queue with rates counts its requests in the
// windows PostgreSQL's reading of job_data names (1e2 and 100 are one
// value, as the dispatcher's claim reads them), writes their units as a
// claim does, and a claim after it finds those windows full.
func TestIntakeClaimsUnderTheQueueRates(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	st := pgtest.New(t)
	th := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#0", 1, time.Hour, "", "/tenant")}}
	data := func(v string) func(*correlator.Job) {
		return func(j *correlator.Job) { j.JobData = json.RawMessage(`{"tenant": ` + v + `}`) }
	}
	res, err := st.IntakeApply(ctx, limitedBatch(0, th,
		job("a1", data(`"a"`)), job("a2", data(`"a"`)), job("n1", data(`1e2`)), job("n2", data(`100`)), job("none")))
	if err != nil {
		t.Fatal(err)
	}
	if got := keysOf(res.Claimed); !slices.Equal(got, []string{"a1", "n1", "none"}) {
		t.Fatalf("claimed %v, want one job per window: a1, n1, none", got)
	}
	countsAgree(t, st)
	if n := count(t, st, `SELECT count(*) FROM hipq_rate_count WHERE rate = 'q:default#0' AND part IN ('a', '100', '') AND n = 1`); n != 3 {
		t.Fatalf("%d of 3 windows count the claim's request", n)
	}
	// Each unit names its job's attempt as the claim made it.
	if n := count(t, st, `SELECT count(*) FROM hipq_rate_unit u JOIN hipq_attempt a
		ON a.job_id = u.job_ids[1] AND a.attempt = u.attempts[1] AND a.dispatched_at = u.claimed_at`); n != 3 {
		t.Fatalf("%d of 3 units name their claim's attempt", n)
	}
	c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 100, Instance: "test", Throttle: th})
	if err != nil || len(c.Jobs) != 0 {
		t.Fatalf("claim after the intake: %d jobs (%v); want none, every window full", len(c.Jobs), err)
	}
}

// Shares hold at intake: a partition takes no more than its cap, in the
// queue's order (priority first: the higher first), and a job of a partition with
// room is claimed beside it.
func TestIntakeClaimsUnderTheQueueShares(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	st := pgtest.New(t)
	shares, err := correlator.NewShares("/tenant", map[string]int{"a": 1, "b": 1}, 4)
	if err != nil {
		t.Fatal(err)
	}
	th := correlator.Throttle{Limit: 4, Shares: shares}
	tenant := func(v string, prio int) func(*correlator.Job) {
		return func(j *correlator.Job) { j.JobData, j.Priority = json.RawMessage(`{"tenant": "`+v+`"}`), prio }
	}
	b := limitedBatch(0, th,
		job("a1", tenant("a", 100)), job("a2", tenant("a", 100)), job("a3", tenant("a", 1)), job("b1", tenant("b", 100)))
	b.Limits["default"] = store.IntakeLimits{Throttle: th, Order: correlator.OrderPriorityFirst}
	res, err := st.IntakeApply(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	if got := keysOf(res.Claimed); !slices.Equal(got, []string{"a1", "a3", "b1"}) {
		t.Fatalf("claimed %v, want a3 (first in the queue's order), a1 and b1", got)
	}
	wantState(t, get(t, st, "a2"), correlator.StateInitial, "", 0)
}

// A paused queue with limits claims nothing at intake.
func TestIntakeClaimsNothingInAPausedLimitedQueue(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	if _, err := st.Pool().Exec(ctx, `INSERT INTO hipq_queue (name, paused) VALUES ('default', true)`); err != nil {
		t.Fatal(err)
	}
	res, err := st.IntakeApply(ctx, limitedBatch(0, correlator.Throttle{Limit: 5}, job("a"), job("b")))
	if err != nil || res.Inserted != 2 || len(res.Claimed) != 0 {
		t.Fatalf("inserted %d, claimed %d (%v); want 2 stored waiting", res.Inserted, len(res.Claimed), err)
	}
}

// A job asking to be claimed in a queue the batch names no limits for is
// stored waiting: the store never claims past limits it was not told.
func TestIntakeClaimsNothingInAQueueWithoutItsLimits(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	b := claimAll(intakeBatch(-1, 1, job("a"), job("b")))
	b.Limits = nil
	res, err := st.IntakeApply(ctx, b)
	if err != nil || res.Inserted != 2 || len(res.Claimed) != 0 {
		t.Fatalf("inserted %d, claimed %d (%v); want 2 stored waiting", res.Inserted, len(res.Claimed), err)
	}
}

// A claim whose limits leave due jobs waiting says so (Held), whatever
// kept them out of its read (a full share partition here): new jobs of
// the queue come after them. Once none waits, it does not.
func TestClaimSaysWhenLimitsHoldDueJobs(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	shares, err := correlator.NewShares("/tenant", map[string]int{"a": 1, "b": 1}, 4)
	if err != nil {
		t.Fatal(err)
	}
	th := correlator.Throttle{Limit: 4, Shares: shares}
	tenant := func(v string) func(*correlator.Job) {
		return func(j *correlator.Job) { j.JobData = json.RawMessage(`{"tenant": "` + v + `"}`) }
	}
	insert(t, st, job("a1", tenant("a")), job("a2", tenant("a")), job("a3", tenant("a")), job("b1", tenant("b")))
	p := store.JobClaimParams{Queue: "default", Limit: 100, Instance: "test", Throttle: th}
	c, err := st.JobClaim(ctx, p)
	if err != nil || len(c.Jobs) != 3 || !c.Held {
		t.Fatalf("claimed %d, held %v (%v); want 3, a3 held", len(c.Jobs), c.Held, err)
	}
	c, err = st.JobClaim(ctx, p) // (a's partition full: a3 is not even read)
	if err != nil || len(c.Jobs) != 0 || !c.Held {
		t.Fatalf("claimed %d, held %v (%v); want none, a3 held", len(c.Jobs), c.Held, err)
	}
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET state = 'final', outcome = 'succeeded' WHERE job_key = 'a1'`); err != nil {
		t.Fatal(err)
	}
	c, err = st.JobClaim(ctx, p)
	if err != nil || len(c.Jobs) != 1 || c.Held {
		t.Fatalf("claimed %d, held %v (%v); want a3, nothing held", len(c.Jobs), c.Held, err)
	}
}

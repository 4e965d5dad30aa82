package store_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

func rate(t *testing.T, key string, limit int, period time.Duration, jobType, by string) correlator.Rate {
	t.Helper()
	r, err := correlator.NewRate(key, limit, period, jobType, by)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// countsAgree: each window's count is its units', whatever happened.
func countsAgree(t *testing.T, st *store.Store) {
	t.Helper()
	if n := count(t, st, `SELECT count(*) FROM (SELECT rate, part, sum(n) AS n FROM hipq_rate_unit GROUP BY 1, 2 HAVING sum(n) <> 0) u
		FULL JOIN (SELECT rate, part, n FROM hipq_rate_count WHERE n <> 0) c USING (rate, part)
		WHERE u.n IS DISTINCT FROM c.n`); n != 0 {
		t.Errorf("%d windows whose count is not their units'", n)
	}
}

func refsOf(cs []store.Claimed) []store.AttemptRef {
	var out []store.AttemptRef
	for _, c := range cs {
		out = append(out, c.Ref())
	}
	return out
}

// A queue's rate: a claim takes at most limit; while they may be in
// flight nothing more; once sent, the window frees period after the send
// (the claim says when); an undone claim gives its unit back.
func TestRateWindow(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	for i := range 10 {
		insert(t, st, job(fmt.Sprintf("r%d", i)))
	}
	th := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#0", 3, time.Second, "", "")}}
	first := claimWith(t, st, store.JobClaimParams{Throttle: th})
	if len(first.Jobs) != 3 || !first.RateFreeAt.IsZero() {
		t.Fatalf("first claim: %d jobs, free at %v; want 3 and no wake-up (all in flight)", len(first.Jobs), first.RateFreeAt)
	}
	// Undo one: its unit comes back.
	if n, err := st.JobUndoClaim(ctx, refsOf(first.Jobs[:1])); err != nil || n != 1 {
		t.Fatalf("undo: %d %v", n, err)
	}
	again := claimWith(t, st, store.JobClaimParams{Throttle: th})
	if len(again.Jobs) != 1 {
		t.Fatalf("after an undo: %d jobs, want 1", len(again.Jobs))
	}
	sent := append(first.Jobs[1:], again.Jobs...)
	if err := st.AttemptMarkSent(ctx, refsOf(sent)); err != nil {
		t.Fatal(err)
	}
	full := claimWith(t, st, store.JobClaimParams{Throttle: th})
	if len(full.Jobs) != 0 || full.RateFreeAt.IsZero() || full.RateFreeAt.Sub(full.DBNow) > time.Second+100*time.Millisecond {
		t.Fatalf("a full window: %d jobs, free at %v (now %v)", len(full.Jobs), full.RateFreeAt, full.DBNow)
	}
	for time.Now().Before(full.Local.Add(full.RateFreeAt.Sub(full.DBNow))) {
		time.Sleep(20 * time.Millisecond)
	}
	if later := claimWith(t, st, store.JobClaimParams{Throttle: th}); len(later.Jobs) != 3 {
		t.Fatalf("once the window frees: %d jobs, want 3", len(later.Jobs))
	}
	// Units that no longer count are pruned.
	if n := count(t, st, "SELECT coalesce(sum(n), 0) FROM hipq_rate_unit"); n != 3 {
		t.Errorf("%d requests kept, want the 3 in flight", n)
	}
	// An attempt that ends unsent counts until its end.
	inFlight := claimWith(t, st, store.JobClaimParams{Throttle: correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#1", 5, time.Minute, "", "")}}, Limit: 1})
	j := inFlight.Jobs[0]
	if _, err := st.JobResolveMany(ctx, []store.Resolve{{Queue: j.Queue, JobID: j.ID, Attempt: j.Attempt,
		Res: correlator.TimedOut(types["t"], j.Running(), time.Now())}}); err != nil {
		t.Fatal(err)
	}
	claimWith(t, st, store.JobClaimParams{Throttle: correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#1", 5, time.Minute, "", "")}}, Limit: 1})
	if n := count(t, st, "SELECT count(*) FROM hipq_rate_unit WHERE $1 = ANY(job_ids) AND at IS NOT NULL", j.ID); n != 1 {
		t.Errorf("the ended attempt's unit has no end time")
	}
	countsAgree(t, st)
}

// A window per value: a value at its limit is left out of the candidates,
// so another value's jobs behind a long backlog of it are claimed in the
// same claim; critical types are limited too; a type's rate leaves other
// types alone.
func TestRatePerValue(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var jobs []*correlator.Job
	for i := range 1100 {
		jobs = append(jobs, job(fmt.Sprintf("a%04d", i), func(j *correlator.Job) { j.JobData = json.RawMessage(`{"tenant":"A"}`) }))
	}
	for i := range 3 {
		jobs = append(jobs, job(fmt.Sprintf("b%d", i), func(j *correlator.Job) {
			j.JobData = json.RawMessage(`{"tenant":"B"}`)
			j.ScheduledRunTime = time.Now().Add(-time.Millisecond) // behind every A
		}))
	}
	jobs = append(jobs, job("none", func(j *correlator.Job) { j.ScheduledRunTime = time.Now() }))
	insert(t, st, jobs...)
	th := correlator.Throttle{Critical: []string{"t"}, Rates: []correlator.Rate{rate(t, "q:default#0", 2, time.Minute, "", "/tenant")}}
	c := claimWith(t, st, store.JobClaimParams{Throttle: th, Limit: 50})
	got := map[byte]int{}
	for _, j := range c.Jobs {
		got[j.JobKey[0]]++
	}
	if got['a'] != 2 || got['b'] != 2 || got['n'] != 1 || len(c.Jobs) != 5 {
		t.Fatalf("claimed %v, want 2 of A, 2 of B and the one without a tenant", got)
	}
	if c2 := claimWith(t, st, store.JobClaimParams{Throttle: th, Limit: 50}); len(c2.Jobs) != 0 {
		t.Fatalf("every window is full, yet a second claim took %v", keys(c2.Jobs))
	}
	// A type's rate: other types are not limited by it.
	th2 := correlator.Throttle{Rates: []correlator.Rate{rate(t, "t:other#0", 1, time.Minute, "other", "")}}
	if c3 := claimWith(t, st, store.JobClaimParams{Throttle: th2, Limit: 5}); len(c3.Jobs) != 5 {
		t.Fatalf("a rate of another type limited this one: %d", len(c3.Jobs))
	}
	if n, err := st.JobUndoClaim(ctx, refsOf(c.Jobs)); err != nil || n != 5 {
		t.Fatalf("undo: %d %v", n, err)
	}
	countsAgree(t, st)
}

// Values holding any character (the separators a naive key would use
// included) keep windows of their own, under two rates at once.
func TestRateOddValues(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var jobs []*correlator.Job
	for i, tenant := range []string{`x\u001fy`, `x`, `x\u001fy`, `x`, `\u001e`, `\u001e`} {
		jobs = append(jobs, job(fmt.Sprintf("o%d", i), func(j *correlator.Job) {
			j.JobData = json.RawMessage(fmt.Sprintf(`{"tenant":"%s","region":"r\u001e%d"}`, tenant, i%2))
		}))
	}
	insert(t, st, jobs...)
	th := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#0", 5, time.Minute, "", "/region"),
		rate(t, "q:default#1", 1, time.Minute, "", "/tenant")}}
	c := claimWith(t, st, store.JobClaimParams{Throttle: th})
	if got := keys(c.Jobs); len(got) != 3 {
		t.Fatalf("claimed %v, want one per tenant (3)", got)
	}
	if again := claimWith(t, st, store.JobClaimParams{Throttle: th}); len(again.Jobs) != 0 {
		t.Fatalf("every tenant's window is full, yet %v", keys(again.Jobs))
	}
	countsAgree(t, st)
}

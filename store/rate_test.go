package store_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
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
	sent := slices.Concat(first.Jobs[1:], again.Jobs)
	if err := st.AttemptMarkSent(ctx, refsOf(sent)); err != nil {
		t.Fatal(err)
	}
	full := claimWith(t, st, store.JobClaimParams{Throttle: th})
	if len(full.Jobs) != 0 || full.RateFreeAt.IsZero() || full.RateFreeAt.Sub(full.DBNow) > time.Second+100*time.Millisecond {
		t.Fatalf("a full window: %d jobs, free at %v (now %v)", len(full.Jobs), full.RateFreeAt, full.DBNow)
	}
	// (Local is taken before the claim's transaction began: the window may
	// free a little after the moment estimated, so claims are asked until
	// one takes jobs.)
	for time.Now().Before(full.Local.Add(full.RateFreeAt.Sub(full.DBNow))) {
		time.Sleep(20 * time.Millisecond)
	}
	var later store.Claim
	testutil.Eventually(t, 10*time.Second, func() bool {
		later = claimWith(t, st, store.JobClaimParams{Throttle: th})
		return len(later.Jobs) > 0
	}, "a claim once the window frees")
	if len(later.Jobs) != 3 {
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

// A request that may have left keeps counting: a claim undone for a
// re-send (a send in doubt, or the rescue of a claim whose instance died
// after sending) leaves its unit in the window, for a period from the
// claim that settles it; only a claim undone because its request never
// left gives its unit back.
func TestRateCountsRequestsThatMayHaveLeft(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"), job("b"))
	th := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#0", 1, time.Hour, "", "")}}
	first := claimWith(t, st, store.JobClaimParams{Throttle: th})
	if len(first.Jobs) != 1 {
		t.Fatalf("first claim: %d jobs, want 1", len(first.Jobs))
	}
	if n, err := st.JobUndoForResend(ctx, refsOf(first.Jobs)); err != nil || n != 1 {
		t.Fatalf("undo for a re-send: %d %v", n, err)
	}
	if again := claimWith(t, st, store.JobClaimParams{Throttle: th}); len(again.Jobs) != 0 {
		t.Fatalf("a request that may have left was given back: the re-claim took %v within the hour (limit 1)", keys(again.Jobs))
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_rate_unit WHERE at IS NOT NULL AND n = 1"); n != 1 {
		t.Errorf("the unit of the claim in doubt is not timed: %d timed units", n)
	}
	countsAgree(t, st)

	// Through the dispatcher's record of a delivery in doubt, likewise.
	st2 := pgtest.New(t)
	insert(t, st2, job("a"), job("b"))
	c := claimWith(t, st2, store.JobClaimParams{Throttle: th})
	if _, err := st2.DeliveryRecord(ctx, store.Delivery{Resend: refsOf(c.Jobs)}, types); err != nil {
		t.Fatal(err)
	}
	if again := claimWith(t, st2, store.JobClaimParams{Throttle: th}); len(again.Jobs) != 0 {
		t.Fatalf("after a delivery in doubt the re-claim took %v within the hour (limit 1)", keys(again.Jobs))
	}
	// A send refused (never left) gives its unit back.
	st3 := pgtest.New(t)
	insert(t, st3, job("a"), job("b"))
	c = claimWith(t, st3, store.JobClaimParams{Throttle: th})
	if _, err := st3.DeliveryRecord(ctx, store.Delivery{Undo: refsOf(c.Jobs)}, types); err != nil {
		t.Fatal(err)
	}
	if again := claimWith(t, st3, store.JobClaimParams{Throttle: th}); len(again.Jobs) != 1 {
		t.Fatalf("after a send that never left the re-claim took %d jobs, want 1", len(again.Jobs))
	}
	countsAgree(t, st3)
	if n := count(t, st3, "SELECT count(*) FROM hipq_rate_giveback"); n != 0 {
		t.Errorf("%d give-backs left once their claim was settled", n)
	}
}

// A unit counts the requests of its own claim: the claim after an undo
// takes the same attempt number, and its attempt row is not the undone
// claim's. Units whose claims are all gone are settled at the next claim,
// and the windows' counts stay the sum of their units through it all.
func TestRateUnitsBelongToTheirClaim(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"), job("b"), job("c"), job("d"))
	th := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#0", 2, time.Hour, "", "")}}
	one := store.JobClaimParams{Throttle: th, Limit: 1}
	first := claimWith(t, st, one)
	if n, err := st.JobUndoClaim(ctx, refsOf(first.Jobs)); err != nil || n != 1 { // never left
		t.Fatalf("undo: %d %v", n, err)
	}
	again := claimWith(t, st, one)
	if len(again.Jobs) != 1 || again.Jobs[0].ID != first.Jobs[0].ID || again.Jobs[0].Attempt != first.Jobs[0].Attempt {
		t.Fatalf("the re-claim: %v, want the same job and attempt", keys(again.Jobs))
	}
	if err := st.AttemptMarkSent(ctx, refsOf(again.Jobs)); err != nil {
		t.Fatal(err)
	}
	next := claimWith(t, st, one)
	if len(next.Jobs) != 1 {
		t.Fatalf("one request sent of 2 allowed, yet the next claim took %d", len(next.Jobs))
	}
	countsAgree(t, st)
	if n := count(t, st, "SELECT coalesce(sum(n), 0) FROM hipq_rate_count"); n != 2 {
		t.Errorf("the window counts %d, want 2 (one sent, one in flight)", n)
	}
	// A claim in doubt undone, then its job claimed again: both may have
	// reached the downstream, and both count.
	st2 := pgtest.New(t)
	insert(t, st2, job("a"), job("b"))
	first = claimWith(t, st2, one)
	if _, err := st2.JobUndoForResend(ctx, refsOf(first.Jobs)); err != nil {
		t.Fatal(err)
	}
	again = claimWith(t, st2, one)
	if len(again.Jobs) != 1 || again.Jobs[0].ID != first.Jobs[0].ID {
		t.Fatalf("the re-send: %v", keys(again.Jobs))
	}
	countsAgree(t, st2)
	if n := count(t, st2, "SELECT coalesce(sum(n), 0) FROM hipq_rate_count"); n != 2 {
		t.Errorf("the window counts %d, want 2 (the request in doubt and its re-send)", n)
	}
	// A unit whose job is gone (pruned, cancelled) is settled by the next
	// claim, never left in flight for ever.
	if _, err := st2.JobResolveMany(ctx, []store.Resolve{{Queue: again.Jobs[0].Queue, JobID: again.Jobs[0].ID, Attempt: again.Jobs[0].Attempt,
		Res: correlator.TimedOut(types["t"], again.Jobs[0].Running(), time.Now())}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st2.Pool().Exec(ctx, "DELETE FROM hipq_attempt WHERE job_id = $1; ", again.Jobs[0].ID); err != nil {
		t.Fatal(err)
	}
	if _, err := st2.Pool().Exec(ctx, "DELETE FROM hipq_job WHERE id = $1", again.Jobs[0].ID); err != nil {
		t.Fatal(err)
	}
	claimWith(t, st2, one)
	if n := count(t, st2, "SELECT count(*) FROM hipq_rate_unit WHERE at IS NULL AND NOT (job_ids && ARRAY(SELECT id FROM hipq_job))"); n != 0 {
		t.Errorf("%d units of gone jobs still in flight", n)
	}
	countsAgree(t, st2)
}

// Rate state is bounded by the windows that count: once a period has
// passed, the units of 500 values and their windows' counts are gone,
// deleted as they fall to 0, and the next claim reads only what counts.
func TestRateWindowsThatNoLongerCountGo(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var jobs []*correlator.Job
	for i := range 500 {
		jobs = append(jobs, job(fmt.Sprintf("v%03d", i), func(j *correlator.Job) {
			j.JobData = json.RawMessage(fmt.Sprintf(`{"tenant":"t%d"}`, i))
		}))
	}
	jobs = append(jobs, job("second", func(j *correlator.Job) {
		j.JobData = json.RawMessage(`{"tenant":"t0"}`)
		j.ScheduledRunTime = time.Now().Add(time.Second)
	}))
	insert(t, st, jobs...)
	period := 300 * time.Millisecond
	th := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#0", 1, period, "", "/tenant")}}
	first := claimWith(t, st, store.JobClaimParams{Throttle: th, Limit: 1000})
	if len(first.Jobs) != 500 {
		t.Fatalf("claimed %d, want 500 (one per tenant)", len(first.Jobs))
	}
	if err := st.AttemptMarkSent(ctx, refsOf(first.Jobs)); err != nil {
		t.Fatal(err)
	}
	// The job of t0 left is due a second later, its window by then past.
	testutil.Eventually(t, 20*time.Second, func() bool {
		c := claimWith(t, st, store.JobClaimParams{Throttle: th, Limit: 1000})
		if len(c.Jobs) > 1 {
			t.Fatalf("claimed %v, want the second job of t0 alone", keys(c.Jobs))
		}
		return len(c.Jobs) == 1
	}, "the second job of t0, once due")
	if n := count(t, st, "SELECT count(*) FROM hipq_rate_count"); n != 1 {
		t.Errorf("%d windows kept, want the one that counts", n)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_rate_unit"); n != 1 {
		t.Errorf("%d units kept, want the one that counts", n)
	}
	countsAgree(t, st)
}

// A send that surely never left and ended the attempt (every send refused
// past the send timeout, a record the broker would not write) gives its
// request back, as an undo of a send that never left does.
func TestRateNeverLeftResolvesGiveBack(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"), job("b"))
	th := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#0", 1, time.Hour, "", "")}}
	c := claimWith(t, st, store.JobClaimParams{Throttle: th})
	j := c.Jobs[0]
	fail := store.Resolve{Queue: j.Queue, JobID: j.ID, Attempt: j.Attempt, Claim: j.StartedAt, NeverLeft: true,
		Res: correlator.DispatchFailed(types["t"], j.Running(), "refused", false, correlator.RetryAfter{}, time.Now())}
	if _, err := st.DeliveryRecord(ctx, store.Delivery{Resolves: []store.Resolve{fail}}, types); err != nil {
		t.Fatal(err)
	}
	if again := claimWith(t, st, store.JobClaimParams{Throttle: th}); len(again.Jobs) != 1 {
		t.Fatalf("after a send that never left the next claim took %d jobs, want 1", len(again.Jobs))
	}
	countsAgree(t, st)
}

// A request whose claim is settled after the claim waited for the queue's
// lock counts from the moment it was settled, never from the start of the
// claim's transaction: an undo for a re-send that commits while the claim
// waits is not dated before it happened.
func TestRateSettlesOnTheClockAfterTheLock(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"), job("b"))
	th := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#0", 1, time.Hour, "", "")}}
	first := claimWith(t, st, store.JobClaimParams{Throttle: th})
	holder, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('hipq_claim/' || current_schema() || '/default', 0))`); err != nil {
		t.Fatal(err)
	}
	done := make(chan store.Claim, 1)
	go func() {
		c, _ := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Instance: "test", Limit: 100, Throttle: th})
		done <- c
	}()
	deadline := time.Now().Add(10 * time.Second)
	for count(t, st, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%hipq_claim%'`) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the claim never waited for the queue's lock")
		}
		time.Sleep(10 * time.Millisecond) // (a poll with a deadline)
	}
	if n, err := st.JobUndoForResend(ctx, refsOf(first.Jobs)); err != nil || n != 1 {
		t.Fatalf("undo: %d %v", n, err)
	}
	var undone time.Time
	if err := st.Pool().QueryRow(ctx, "SELECT clock_timestamp()").Scan(&undone); err != nil {
		t.Fatal(err)
	}
	if err := holder.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if c := <-done; len(c.Jobs) != 0 {
		t.Fatalf("the waiting claim took %v within the hour (limit 1)", keys(c.Jobs))
	}
	var at time.Time
	if err := st.Pool().QueryRow(ctx, "SELECT at FROM hipq_rate_unit WHERE at IS NOT NULL").Scan(&at); err != nil {
		t.Fatal(err)
	}
	if at.Before(undone) {
		t.Errorf("the request in doubt counts from %v, before its undo ended (%v)", at, undone)
	}
}

// A unit written before version 17 (no claim named) never counts more
// than it did: a member given back then stays given back.
func TestRateLegacyUnitsNeverGrow(t *testing.T) {
	pgtest.SkipOnCitus(t, "a unit from before version 17 has no queue, which on Citus is hipq_rate_unit's distribution column: "+
		"hipq migrate --distribute deletes such units, and none is written there (TestMigrateDistributeMovesASingleNodeSchema)")
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"), job("b"), job("c"))
	th := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:default#0", 3, time.Hour, "", "")}}
	c := claimWith(t, st, store.JobClaimParams{Throttle: th, Limit: 2})
	if _, err := st.JobUndoClaim(ctx, refsOf(c.Jobs[:1])); err != nil {
		t.Fatal(err)
	}
	// As version 16 left it: the member given back is still in the
	// arrays, n already lowered, no claim named, no give-back row.
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_rate_unit SET claimed_at = NULL, queue = NULL, n = 1;
		UPDATE hipq_rate_count SET n = 1; DELETE FROM hipq_rate_giveback`); err != nil {
		t.Fatal(err)
	}
	claimWith(t, st, store.JobClaimParams{Throttle: th, Limit: 1})
	if n := count(t, st, "SELECT coalesce(sum(n), 0) FROM hipq_rate_unit WHERE claimed_at IS NULL"); n > 1 {
		t.Errorf("the legacy unit counts %d, more than the 1 it counted", n)
	}
	countsAgree(t, st)
}

// Version 23 gives each window's count the queue of its rate (laid out by
// queue on Citus): a queue's rate's from its key, a type's from its
// window's units, or its rate's; units from before version 17 get theirs
// first, from their key or their jobs. A window nothing tells the queue of
// keeps none, and its count.
func TestMigrationGivesRateCountsTheirQueue(t *testing.T) {
	t.Parallel()
	const schema = "hipq_from22"
	st, err := store.Open(ctx, store.Config{URL: pgtest.URL(t), Schema: schema, Citus: store.CitusOff})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	migrateAsRelease(t, st.Pool(), schema, 22)
	var id int64
	if err := st.Pool().QueryRow(ctx, `INSERT INTO hipq_job (queue, job_type, job_key, state) VALUES ('qt', 'tt', 'k', 'running')
		RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, `
		INSERT INTO hipq_rate_unit (queue, rate, part, job_ids, attempts, n) VALUES
		    (NULL, 'q:my#q#0', '', '{0}', '{1}', 1),
		    (NULL, 't:tt#0', '', ARRAY[$1::bigint], '{1}', 1),
		    (NULL, 't:gone#0', '', '{0}', '{1}', 1),
		    ('old', 't:x#0', 'p', '{0}', '{1}', 1),
		    ('qx', 't:x#0', 'p', '{0}', '{1}', 1)`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, `INSERT INTO hipq_rate_count (rate, part, n) VALUES
		    ('q:my#q#0', '', 1), ('t:tt#0', '', 1), ('t:gone#0', '', 1), ('t:x#0', 'p', 2), ('t:x#0', 'other', 1),
		    ('t:none#0', '', 1)`); err != nil {
		t.Fatal(err)
	}
	if applied, err := st.Migrate(ctx); err != nil || len(applied) == 0 || applied[0].Version != 23 {
		t.Fatalf("upgrade from 22: applied %v, %v", applied, err)
	}
	want := "q:my#q#0  my#q 1, t:gone#0  - 1, t:none#0  - 1, t:tt#0  qt 1, t:x#0 other qx 1, t:x#0 p qx 2"
	var got string
	if err := st.Pool().QueryRow(ctx, `SELECT string_agg(format('%s %s %s %s', rate, part, coalesce(queue, '-'), n), ', ' ORDER BY rate, part)
		FROM hipq_rate_count`).Scan(&got); err != nil || got != want {
		t.Fatalf("counts after the upgrade:\n%s (%v)\nwant\n%s", got, err, want)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_rate_unit WHERE queue IS NULL AND rate <> 't:gone#0'"); n != 0 {
		t.Errorf("%d units from before version 17 left without the queue their key or job tells", n)
	}
}

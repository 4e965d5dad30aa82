package store_test

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

func claimWith(t *testing.T, st *store.Store, p store.JobClaimParams) store.Claim {
	t.Helper()
	p.Queue, p.Instance = "default", "test"
	if p.Limit == 0 {
		p.Limit = 100
	}
	c, err := st.JobClaim(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func keys(c []store.Claimed) []string {
	var out []string
	for _, j := range c {
		out = append(out, j.JobKey)
	}
	return out
}

func factor(n int) func(*correlator.Job) { return func(j *correlator.Job) { j.ThrottleFactor = n } }
func ofType(typ string) func(*correlator.Job) {
	return func(j *correlator.Job) { j.JobType = typ }
}
func region(r string) func(*correlator.Job) {
	return func(j *correlator.Job) { j.JobData = json.RawMessage(fmt.Sprintf(`{"region":%q}`, r)) }
}

var base = time.Now()

func at(ago time.Duration) func(*correlator.Job) {
	return func(j *correlator.Job) { j.ScheduledRunTime = base.Add(-ago) }
}
func prio(p int) func(*correlator.Job) { return func(j *correlator.Job) { j.Priority = p } }

// finish ends running jobs so their throttle weight is free again.
func finish(t *testing.T, st *store.Store, cs ...store.Claimed) {
	t.Helper()
	var rs []store.Resolve
	for _, c := range cs {
		rs = append(rs, store.Resolve{Queue: c.Queue, JobID: c.ID, Attempt: c.Attempt,
			Res: correlator.Replied(nil, c.Running(), &correlator.Reply{Success: true}, time.Now())})
	}
	if _, err := st.JobResolveMany(ctx, rs); err != nil {
		t.Fatal(err)
	}
}

// In the queue's order, a job too heavy for the capacity left is skipped
// and lighter ones behind it run (SPEC §5, §8).
func TestClaimThrottleSkipsTooHeavy(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a3", factor(3), at(5*time.Second)), job("b3", factor(3), at(4*time.Second)),
		job("c1", at(3*time.Second)), job("d1", at(2*time.Second)), job("e1", at(time.Second)))
	th := correlator.Throttle{Limit: 5}
	got := claimWith(t, st, store.JobClaimParams{Throttle: th})
	if want := []string{"a3", "c1", "d1"}; !slices.Equal(keys(got.Jobs), want) {
		t.Fatalf("claimed %v, want %v", keys(got.Jobs), want)
	}
	if again := claimWith(t, st, store.JobClaimParams{Throttle: th}); len(again.Jobs) != 0 {
		t.Fatalf("claimed %v over a full queue", keys(again.Jobs))
	}
	finish(t, st, got.Jobs[0]) // 3 free: b3 is next in order and fits
	if again := claimWith(t, st, store.JobClaimParams{Throttle: th}); !slices.Equal(keys(again.Jobs), []string{"b3"}) {
		t.Fatalf("after a slot freed: claimed %v, want [b3]", keys(again.Jobs))
	}
}

// Both orders: scheduled_first is time then priority, priority_first the
// other way round; lower priority numbers first.
func TestClaimOrder(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		order correlator.Order
		want  []string
	}{
		{correlator.OrderScheduledFirst, []string{"old-p9", "mid-p5", "new-p1", "new-p2"}},
		{correlator.OrderPriorityFirst, []string{"new-p1", "new-p2", "mid-p5", "old-p9"}},
	} {
		t.Run(string(tc.order), func(t *testing.T) {
			st := pgtest.New(t)
			insert(t, st, job("new-p2", prio(2), at(time.Second)), job("mid-p5", prio(5), at(time.Minute)),
				job("old-p9", prio(9), at(time.Hour)), job("new-p1", prio(1), at(time.Second)))
			var got []string
			for range 4 { // limit 1: one at a time, in order
				c := claimWith(t, st, store.JobClaimParams{Order: tc.order, Throttle: correlator.Throttle{Limit: 1}})
				got = append(got, keys(c.Jobs)...)
				finish(t, st, c.Jobs...)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("order %v, want %v", got, tc.want)
			}
			// Without limits (one statement, no walk): all at once, in order.
			st = pgtest.New(t)
			insert(t, st, job("new-p2", prio(2), at(time.Second)), job("mid-p5", prio(5), at(time.Minute)),
				job("old-p9", prio(9), at(time.Hour)), job("new-p1", prio(1), at(time.Second)), job("later", at(-time.Hour)))
			c := claimWith(t, st, store.JobClaimParams{Order: tc.order})
			if got := keys(c.Jobs); !slices.Equal(got, tc.want) || len(c.Closed) != 0 {
				t.Fatalf("unbounded claim took %v (closed %v), want %v", got, c.Closed, tc.want)
			}
			c = claimWith(t, st, store.JobClaimParams{Order: tc.order, Limit: 2})
			if len(c.Jobs)+len(c.Closed) != 0 {
				t.Fatalf("claimed again: %+v", c)
			}
		})
	}
}

// Claimers of a queue without limits, many at once, each claim a job at
// most once (its locked rows are skipped by the others) and write exactly
// one attempt row per claim; together they take every due job.
func TestClaimUnboundedConcurrent(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var js []*correlator.Job
	for i := range 2000 {
		js = append(js, job(fmt.Sprintf("j%d", i), prio(i%7)))
	}
	insert(t, st, js...)
	seen := make(chan []int64, 8)
	for w := range 8 {
		go func() {
			var ids []int64
			for {
				c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 50 + 25*w, Instance: fmt.Sprint("w", w)})
				if err != nil {
					t.Error(err)
					break
				}
				if len(c.Jobs) == 0 {
					break
				}
				for _, j := range c.Jobs {
					if j.Attempt != 1 {
						t.Errorf("job %d claimed at attempt %d", j.ID, j.Attempt)
					}
					ids = append(ids, j.ID)
				}
			}
			seen <- ids
		}()
	}
	claimed := map[int64]bool{}
	for range 8 {
		for _, id := range <-seen {
			if claimed[id] {
				t.Fatalf("job %d claimed twice", id)
			}
			claimed[id] = true
		}
	}
	if len(claimed) != 2000 {
		t.Fatalf("%d of 2000 jobs claimed", len(claimed))
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_attempt"); n != 2000 {
		t.Fatalf("%d attempt rows for 2000 claims", n)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_job WHERE state = 'running' AND attempt = 1"); n != 2000 {
		t.Fatalf("%d of 2000 jobs running", n)
	}
}

// A claim of several types passes over the due jobs another transaction
// holds (another instance's claim, say) and takes the next ones: a whole
// batch, not what is left of the first batch's worth.
func TestClaimOfTypesPassesOverHeldRows(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var js []*correlator.Job
	for i := range 40 {
		typ := "t"
		if i%2 == 1 {
			typ = "u"
		}
		js = append(js, job(fmt.Sprintf("j%02d", i), ofType(typ), at(time.Duration(100-i)*time.Second)))
	}
	insert(t, st, js...)
	tx, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// The ten oldest, held.
	if _, err := tx.Exec(ctx, `SELECT id FROM hipq_job WHERE queue = 'default' ORDER BY scheduled_run_time LIMIT 10 FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	c := claimWith(t, st, store.JobClaimParams{Limit: 10, Types: []string{"t", "u"}})
	want := []string{"j10", "j11", "j12", "j13", "j14", "j15", "j16", "j17", "j18", "j19"}
	if got := keys(c.Jobs); !slices.Equal(got, want) {
		t.Fatalf("claimed %v beside ten held rows, want %v", got, want)
	}
}

// A partition with room left, but less than its jobs weigh, starves no
// other: beside 2,000 older jobs of a partition running 48 of its 50, each
// weighing 3, a claim reads on past them and takes the other partition's.
// Neither does a backlog of jobs outside their time windows hold up the
// jobs behind it in a busy queue.
func TestClaimReadsPastJobsItPassesOver(t *testing.T) {
	t.Parallel()
	t.Run("shares", func(t *testing.T) {
		t.Parallel()
		st := pgtest.New(t)
		s, err := correlator.NewShares("/region", map[string]int{"a": 1, "b": 1}, 100)
		if err != nil {
			t.Fatal(err)
		}
		th := correlator.Throttle{Limit: 100, Shares: s}
		var js []*correlator.Job
		for i := range 16 {
			js = append(js, job(fmt.Sprintf("run-%02d", i), region("a"), factor(3), at(3*time.Hour)))
		}
		insert(t, st, js...)
		if c := claimWith(t, st, store.JobClaimParams{Limit: 16, Throttle: th}); len(c.Jobs) != 16 {
			t.Fatalf("claimed %d of a's 16 running jobs", len(c.Jobs))
		}
		js = nil
		for i := range 2000 {
			js = append(js, job(fmt.Sprintf("a-%04d", i), region("a"), factor(3), at(2*time.Hour)))
		}
		for i := range 100 {
			js = append(js, job(fmt.Sprintf("b-%03d", i), region("b"), at(time.Hour)))
		}
		insert(t, st, js...)
		c := claimWith(t, st, store.JobClaimParams{Limit: 500, Throttle: th})
		if len(c.Jobs) != 50 || !strings.HasPrefix(c.Jobs[0].JobKey, "b-") {
			t.Fatalf("claimed %d jobs (%v), want b's 50", len(c.Jobs), keys(c.Jobs)[:min(3, len(c.Jobs))])
		}
	})
	t.Run("windows", func(t *testing.T) {
		t.Parallel()
		st := pgtest.New(t)
		now := time.Now().UTC()
		closed := []correlator.TimeWindow{{Start: now.Add(-2 * time.Hour).Format("15:04"), End: now.Add(-time.Hour).Format("15:04"), TZ: "UTC"}}
		th := correlator.Throttle{Limit: 10}
		var js []*correlator.Job
		for i := range 9 {
			js = append(js, job(fmt.Sprintf("run-%d", i), at(3*time.Hour)))
		}
		insert(t, st, js...)
		if c := claimWith(t, st, store.JobClaimParams{Limit: 9, Throttle: th}); len(c.Jobs) != 9 {
			t.Fatalf("claimed %d of 9 running jobs", len(c.Jobs))
		}
		js = nil
		for i := range 500 {
			js = append(js, job(fmt.Sprintf("closed-%03d", i), at(2*time.Hour), func(j *correlator.Job) { j.TimeWindows = closed }))
		}
		js = append(js, job("open", at(time.Hour)))
		insert(t, st, js...)
		c := claimWith(t, st, store.JobClaimParams{Limit: 100, Throttle: th})
		if got := keys(c.Jobs); !slices.Equal(got, []string{"open"}) {
			t.Fatalf("claimed %v behind 500 jobs outside their windows, want the open one", got)
		}
	})
}

// A partition runs at most floor(limit × weight ÷ total), at least 1;
// values not listed share the "*" weight as one pool, or with no "*" only
// the queue limit bounds them.
func TestClaimShares(t *testing.T) {
	t.Parallel()
	mk := func(weights map[string]int, limit int) correlator.Throttle {
		s, err := correlator.NewShares("/region", weights, limit)
		if err != nil {
			t.Fatal(err)
		}
		return correlator.Throttle{Limit: limit, Shares: s}
	}
	fill := func(st *store.Store, regions ...string) {
		var js []*correlator.Job
		for _, r := range regions {
			for i := range 10 {
				js = append(js, job(fmt.Sprintf("%s-%d", r, i), region(r)))
			}
		}
		insert(t, st, js...)
	}
	byRegion := func(c store.Claim) map[string]int {
		out := map[string]int{}
		for _, j := range c.Jobs {
			var d struct{ Region string }
			_ = json.Unmarshal(j.JobData, &d)
			out[d.Region]++
		}
		return out
	}
	t.Run("listed", func(t *testing.T) {
		st := pgtest.New(t)
		fill(st, "east", "north", "west", "south")
		// 10 × 40/100 = 4, 10 × 30/100 = 3 each; south is not listed and there is no "*".
		got := byRegion(claimWith(t, st, store.JobClaimParams{Throttle: mk(map[string]int{"east": 40, "north": 30, "west": 20}, 10)}))
		// east 4, north 3, west 2: 9 of 10, so south (bounded by the queue only) gets the last 1.
		if want := map[string]int{"east": 4, "north": 3, "west": 2, "south": 1}; !mapsEqual(got, want) {
			t.Fatalf("claimed %v, want %v", got, want)
		}
	})
	t.Run("pooled", func(t *testing.T) {
		st := pgtest.New(t)
		fill(st, "east", "north", "west")
		got := byRegion(claimWith(t, st, store.JobClaimParams{Throttle: mk(map[string]int{"east": 50, "*": 25}, 8)}))
		// east 8×50/75 = 5; north and west together 8×25/75 = 2.
		if got["east"] != 5 || got["north"]+got["west"] != 2 {
			t.Fatalf("claimed %v, want east 5 and 2 between north and west", got)
		}
	})
	t.Run("at least 1", func(t *testing.T) {
		st := pgtest.New(t)
		fill(st, "big", "tiny")
		got := byRegion(claimWith(t, st, store.JobClaimParams{Throttle: mk(map[string]int{"big": 99, "tiny": 1}, 10)}))
		if want := map[string]int{"big": 9, "tiny": 1}; !mapsEqual(got, want) {
			t.Fatalf("claimed %v, want %v", got, want)
		}
	})
}

func mapsEqual(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// Critical types pass a full queue and take no capacity; max_concurrency
// caps a type (critical or not) by count.
func TestClaimCriticalAndMaxConcurrency(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var js []*correlator.Job
	for i := range 5 {
		js = append(js, job(fmt.Sprintf("n%d", i), at(time.Hour)), job(fmt.Sprintf("crit%d", i), ofType("crit"), factor(7)),
			job(fmt.Sprintf("cap%d", i), ofType("capped"), at(2*time.Hour)))
	}
	insert(t, st, js...)
	th := correlator.Throttle{Limit: 2, Critical: []string{"crit"}, MaxConcurrency: map[string]int{"crit": 3, "capped": 1}}
	first := claimWith(t, st, store.JobClaimParams{Throttle: th})
	count := func(c []store.Claimed) map[string]int {
		out := map[string]int{}
		for _, j := range c {
			out[j.JobType]++
		}
		return out
	}
	// Oldest first: one capped (its cap), then one t fills the queue;
	// crit runs beside them (3 of them, its cap) though heavier than the
	// whole limit.
	if got, want := count(first.Jobs), map[string]int{"capped": 1, "t": 1, "crit": 3}; !mapsEqual(got, want) {
		t.Fatalf("claimed %v, want %v", got, want)
	}
	if again := claimWith(t, st, store.JobClaimParams{Throttle: th}); len(again.Jobs) != 0 {
		t.Fatalf("claimed %v with the queue full and crit at its cap", keys(again.Jobs))
	}
	// The capped job ends: the next capped (oldest) takes its place.
	for _, j := range first.Jobs {
		if j.JobType == "capped" {
			finish(t, st, j)
		}
	}
	second := claimWith(t, st, store.JobClaimParams{Throttle: th})
	if got, want := count(second.Jobs), map[string]int{"capped": 1}; !mapsEqual(got, want) {
		t.Fatalf("claimed %v, want %v", got, want)
	}
}

// A job found outside its time windows is not claimed: it comes back as
// Closed, and JobDefer moves it to the next opening without using an
// attempt, or ends it expired when that is past its expiry.
func TestClaimWindowsAndDefer(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	now := time.Now().UTC()
	// A one-hour window that closed an hour ago, today's clock in UTC.
	closedStart := now.Add(-2 * time.Hour).Format("15:04")
	closedEnd := now.Add(-time.Hour).Format("15:04")
	closed := []correlator.TimeWindow{{Start: closedStart, End: closedEnd, TZ: "UTC"}}
	open := []correlator.TimeWindow{{Start: now.Add(-time.Hour).Format("15:04"), End: now.Add(time.Hour).Format("15:04"), TZ: "UTC"}}
	soon := now.Add(time.Hour)
	insert(t, st,
		job("own-closed", func(j *correlator.Job) { j.TimeWindows = closed }),
		job("own-open", func(j *correlator.Job) { j.TimeWindows = open }),
		job("type-closed", ofType("windowed")),
		job("own-open-over-type", ofType("windowed"), func(j *correlator.Job) { j.TimeWindows = open }),
		job("closed-expiring", func(j *correlator.Job) { j.TimeWindows = closed; j.ExpiresAt = &soon }),
	)
	c := claimWith(t, st, store.JobClaimParams{TypeWindows: map[string][]correlator.TimeWindow{"windowed": closed}})
	if got := keys(c.Jobs); !slices.Equal(sorted(got), []string{"own-open", "own-open-over-type"}) {
		t.Fatalf("claimed %v", got)
	}
	var ds []store.Deferral
	for _, x := range c.Closed {
		ws := x.TimeWindows
		if ws == nil {
			ws = closed
		}
		if err := correlator.CompileWindows(ws); err != nil {
			t.Fatal(err)
		}
		next := correlator.NextAllowed(ws, now)
		ds = append(ds, store.Deferral{Queue: x.Queue, ID: x.ID, State: x.State, Attempt: x.Attempt, RunAt: next,
			Expire: x.ExpiresAt != nil && !next.Before(*x.ExpiresAt)})
	}
	if len(c.Closed) != 3 {
		t.Fatalf("%d closed jobs, want 3", len(c.Closed))
	}
	if n, err := st.JobDefer(ctx, ds); err != nil || n != 3 {
		t.Fatalf("deferred %d, err %v", n, err)
	}
	stale := ds[0]
	stale.Attempt++
	if n, _ := st.JobDefer(ctx, []store.Deferral{stale}); n != 0 {
		t.Fatalf("a deferral with a stale attempt moved %d rows", n)
	}
	j := get(t, st, "own-closed")
	wantState(t, j, correlator.StateInitial, "", 0)
	if d := j.ScheduledRunTime.Sub(now); d < 21*time.Hour || d > 23*time.Hour {
		t.Fatalf("rescheduled %v ahead, want to tomorrow's opening (~22h)", d)
	}
	wantState(t, get(t, st, "closed-expiring"), correlator.StateFinal, correlator.OutcomeExpired, 0)
	if n := count(t, st, "SELECT count(*) FROM hipq_attempt a JOIN hipq_job j ON j.queue = a.queue AND j.id = a.job_id WHERE j.job_key IN ('own-closed', 'type-closed')"); n != 0 {
		t.Fatalf("a reschedule left %d attempt rows", n)
	}
	if again := claimWith(t, st, store.JobClaimParams{TypeWindows: map[string][]correlator.TimeWindow{"windowed": closed}}); len(again.Jobs)+len(again.Closed) != 0 {
		t.Fatalf("rescheduled jobs came back at once: %+v", again)
	}
}

func sorted(s []string) []string { sort.Strings(s); return s }

// A paused queue (hipq_queue) claims nothing until resumed.
func TestClaimPausedQueue(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("p1"))
	if _, err := st.Pool().Exec(ctx, "INSERT INTO hipq_queue (name, paused) VALUES ('default', true)"); err != nil {
		t.Fatal(err)
	}
	if c := claimWith(t, st, store.JobClaimParams{}); len(c.Jobs) != 0 {
		t.Fatal("a paused queue was claimed")
	}
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_queue SET paused = false"); err != nil {
		t.Fatal(err)
	}
	if c := claimWith(t, st, store.JobClaimParams{}); len(c.Jobs) != 1 {
		t.Fatal("a resumed queue was not claimed")
	}
}

// Concurrent claimers of one throttled queue never overshoot its limit:
// the claim is serialized per queue, each counting what the others took.
func TestClaimThrottleConcurrent(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var js []*correlator.Job
	for i := range 300 {
		js = append(js, job(fmt.Sprintf("j%d", i), factor(1+i%3)))
	}
	insert(t, st, js...)
	const limit = 7
	done := make(chan int)
	var peak atomic.Int64 // racy max, good enough to see the limit was reached
	for w := range 6 {
		go func() {
			r := rand.New(rand.NewPCG(uint64(w), 1))
			claimed := 0
			// (A failed check ends this goroutine: it still answers.)
			defer func() { done <- claimed }()
			var held []store.Claimed
			for range 40 {
				c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 1 + r.IntN(5), Instance: "w",
					Throttle: correlator.Throttle{Limit: limit}})
				if err != nil {
					t.Error(err)
					break
				}
				claimed += len(c.Jobs)
				held = append(held, c.Jobs...)
				if r.IntN(2) == 0 { // the replies to what this worker holds come in
					finish(t, st, held...)
					held = nil
				}
				w := count(t, st, "SELECT coalesce(sum(throttle_factor), 0) FROM hipq_job WHERE state = 'running'")
				if w > limit {
					t.Errorf("running weight %d above the limit %d", w, limit)
				}
				peak.Store(max(peak.Load(), int64(w)))
			}
			finish(t, st, held...)
		}()
	}
	total := 0
	for range 6 {
		total += <-done
	}
	if total < 30 || peak.Load() < limit-2 {
		t.Fatalf("%d claims, peak weight %d: the test did not exercise the limit", total, peak.Load())
	}
	t.Logf("%d claims, peak running weight %d of %d", total, peak.Load(), limit)
}

// The dispatcher's probe for due jobs is never narrower than the claim:
// wherever a claim of some types takes or defers a job, JobsDue of those
// types says a job is due. And it is as narrow as it can be: no job due
// in a paused queue, nor when only other types, future, expired, running
// or final jobs are there.
func TestDueProbeIsWiderThanTheClaim(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	now := time.Now().UTC()
	closed := []correlator.TimeWindow{{Start: now.Add(-2 * time.Hour).Format("15:04"), End: now.Add(-time.Hour).Format("15:04"), TZ: "UTC"}}
	past := now.Add(-time.Minute)
	inQueue := func(q string) func(j *correlator.Job) { return func(j *correlator.Job) { j.Queue = q } }
	cases := []struct {
		queue string
		jobs  []*correlator.Job
		sql   string // then run on them
		due   bool
	}{
		{"initial", []*correlator.Job{job("a")}, "", true},
		{"retry", []*correlator.Job{job("a")}, "UPDATE hipq_job SET state = 'retry', attempt = 1 WHERE queue = 'retry'", true},
		{"closed", []*correlator.Job{job("a", func(j *correlator.Job) { j.TimeWindows = closed })}, "", true},
		{"future", []*correlator.Job{job("a", func(j *correlator.Job) { j.ScheduledRunTime = now.Add(time.Hour) })}, "", false},
		{"expired", []*correlator.Job{job("a", func(j *correlator.Job) { j.ExpiresAt = &past })}, "", false},
		{"other-type", []*correlator.Job{job("a", ofType("other"))}, "", false},
		{"running", []*correlator.Job{job("a")}, "UPDATE hipq_job SET state = 'running', attempt = 1, started_at = now() WHERE queue = 'running'", false},
		{"final", []*correlator.Job{job("a")}, "UPDATE hipq_job SET state = 'final', outcome = 'succeeded' WHERE queue = 'final'", false},
		{"paused", []*correlator.Job{job("a")}, "INSERT INTO hipq_queue (name, paused) VALUES ('paused', true)", false},
	}
	for _, c := range cases {
		for _, j := range c.jobs {
			inQueue(c.queue)(j)
			j.JobKey = c.queue + "-" + j.JobKey
		}
		insert(t, st, c.jobs...)
		if c.sql != "" {
			if _, err := st.Pool().Exec(ctx, c.sql); err != nil {
				t.Fatalf("%s: %v", c.queue, err)
			}
		}
		due, err := st.JobsDue(ctx, c.queue, []string{"t"})
		if err != nil {
			t.Fatal(err)
		}
		cl, err := st.JobClaim(ctx, store.JobClaimParams{Queue: c.queue, Instance: "test", Limit: 10, Types: []string{"t"}})
		if err != nil {
			t.Fatal(err)
		}
		if found := len(cl.Jobs) + len(cl.Closed); found > 0 && !due {
			t.Errorf("%s: the claim found %d jobs where the probe found none due", c.queue, found)
		}
		if due != c.due {
			t.Errorf("%s: due %v, want %v", c.queue, due, c.due)
		}
	}
}

// When the second statement of a claim without limits (the open jobs with
// time windows) fails, the jobs the first one moved are still returned, to
// be sent, and the claim says why the others were not moved; they wait.
func TestClaimReturnsTheFirstStatementsJobsWhenTheSecondFails(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test fails the second statement with a trigger, which Citus refuses on a distributed table")
	t.Parallel()
	st := pgtest.New(t)
	allDay := []correlator.TimeWindow{{Start: "00:00", End: "23:59", TZ: "UTC"}}
	insert(t, st, job("plain"), job("windowed", func(j *correlator.Job) { j.TimeWindows = allDay }))
	if _, err := st.Pool().Exec(ctx, `
		CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused by the test'; END $$;
		CREATE TRIGGER refuse BEFORE UPDATE ON hipq_job FOR EACH ROW WHEN (OLD.job_key = 'windowed') EXECUTE FUNCTION refuse()`); err != nil {
		t.Fatal(err)
	}
	c := claimWith(t, st, store.JobClaimParams{})
	if got := keys(c.Jobs); !slices.Equal(got, []string{"plain"}) || c.WindowsErr == nil {
		t.Fatalf("claimed %v, windows error %v; want plain, and why windowed was not", got, c.WindowsErr)
	}
	wantState(t, get(t, st, "windowed"), correlator.StateInitial, "", 0)
}

package store_test

import (
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// claimAll asks for every job of b to be claimed as it is stored, in
// queues without limits.
func claimAll(b store.IntakeBatch) store.IntakeBatch {
	b.Limits = map[string]store.IntakeLimits{}
	for i := range b.Jobs {
		b.Jobs[i].Claim = true
		b.Limits[b.Jobs[i].Job.Queue] = store.IntakeLimits{}
	}
	b.Instance = "fast"
	return b
}

func keysOf(cs []store.Claimed) []string {
	var out []string
	for _, c := range cs {
		out = append(out, c.JobKey)
	}
	slices.Sort(out)
	return out
}

// Due jobs the intake asks to claim are stored running, attempt 1, with
// their attempt rows, as a claim leaves them (one write of the row instead
// of an insert and a claim); a job that is not due, has expired, has time
// windows of its own or was not asked for is stored waiting, as is a
// duplicate of a job in flight (not stored at all).
func TestIntakeClaimsDueJobs(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("dup", func(j *correlator.Job) { j.ScheduledRunTime = time.Now().Add(time.Hour) })) // (not due: a due one would come first)
	past := time.Now().Add(-time.Hour)
	b := claimAll(intakeBatch(-1, 7,
		job("due", func(j *correlator.Job) { j.JobData = json.RawMessage(`{"b":1,  "a":2}`) }),
		job("later", func(j *correlator.Job) { j.ScheduledRunTime = time.Now().Add(time.Hour) }),
		job("expired", func(j *correlator.Job) { j.ExpiresAt = &past }),
		job("windowed", func(j *correlator.Job) {
			j.TimeWindows = []correlator.TimeWindow{{Start: "00:00", End: "23:59"}}
		}),
		job("dup"),
		job("unasked"),
		job("due2", func(j *correlator.Job) { j.ScheduledRunTime = time.Time{} })))
	b.Jobs[5].Claim = false
	before := time.Now()
	res, err := st.IntakeApply(ctx, b)
	if err != nil || res.Inserted != 6 || res.Duplicates != 1 {
		t.Fatalf("res %+v: %v", res, err)
	}
	if got := keysOf(res.Claimed); !slices.Equal(got, []string{"due", "due2"}) {
		t.Fatalf("claimed %v, want the due ones", got)
	}
	for _, c := range res.Claimed {
		if c.JobKey == "due" && string(c.JobData) != `{"a": 2, "b": 1}` {
			t.Errorf("job_data %s: want it as stored (and as the claim returns it), not as it came", c.JobData)
		}
		j := get(t, st, c.JobKey)
		wantState(t, j, correlator.StateRunning, "", 1)
		if c.ID != j.ID || c.Attempt != 1 || c.MaxAttempts != j.MaxAttempts || c.TimeoutSeconds != 3600 || c.Queue != "default" ||
			!json.Valid(c.JobData) || c.StartedAt.IsZero() || c.ClaimedLocal.Before(before) {
			t.Errorf("claimed %+v for job %+v", c, j)
		}
		// Its attempt, as a claim writes it: the dispatched_at a record
		// of its send names (the claim's started_at), unsent.
		if n := count(t, st, `SELECT count(*) FROM hipq_attempt a JOIN hipq_job j ON j.queue = a.queue AND j.id = a.job_id AND j.attempt = a.attempt
			WHERE j.id = $1 AND a.instance = 'fast' AND a.dispatched_at = j.started_at AND a.dispatched_at = $2
			AND a.sent_at IS NULL AND a.outcome IS NULL`, c.ID, c.StartedAt); n != 1 {
			t.Errorf("%s: %d attempt rows as a claim writes them", c.JobKey, n)
		}
	}
	for _, k := range []string{"later", "expired", "windowed", "unasked"} {
		wantState(t, get(t, st, k), correlator.StateInitial, "", 0)
	}
	// The claims are the dispatcher's like any: their record moves them.
	refs := make([]store.AttemptRef, len(res.Claimed))
	for i := range res.Claimed {
		refs[i] = res.Claimed[i].Ref()
	}
	if _, err := st.DeliveryRecord(ctx, store.Delivery{Sent: refs}, nil); err != nil {
		t.Fatal(err)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_attempt WHERE instance = 'fast' AND sent_at IS NOT NULL`); n != 2 {
		t.Fatalf("%d of 2 marked sent", n)
	}
}

// A queue with a due job waiting claims no new job at intake (the waiting
// one comes first: the dispatcher claims in the queue's order), nor does
// a paused queue.
func TestIntakeClaimsNothingAheadOfTheQueue(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("waiting"))
	res, err := st.IntakeApply(ctx, claimAll(intakeBatch(-1, 1, job("new"))))
	if err != nil || len(res.Claimed) != 0 {
		t.Fatalf("claimed %v behind a due job: %v", keysOf(res.Claimed), err)
	}
	claimSent(t, st, 10)
	if err := st.QueueSetPaused(ctx, "default", true); err != nil {
		t.Fatal(err)
	}
	res, err = st.IntakeApply(ctx, claimAll(intakeBatch(1, 2, job("paused"))))
	if err != nil || len(res.Claimed) != 0 {
		t.Fatalf("claimed %v in a paused queue: %v", keysOf(res.Claimed), err)
	}
	wantState(t, get(t, st, "paused"), correlator.StateInitial, "", 0)
	if err := st.QueueSetPaused(ctx, "default", false); err != nil {
		t.Fatal(err)
	}
	claimSent(t, st, 10)
	res, err = st.IntakeApply(ctx, claimAll(intakeBatch(2, 3, job("open"))))
	if err != nil || !slices.Equal(keysOf(res.Claimed), []string{"open"}) {
		t.Fatalf("claimed %v in an open queue with nothing due: %v", keysOf(res.Claimed), err)
	}
}

// Invariant 8: a job claimed at intake whose instance died before sending
// it (after the commit, before the delivery) is the rescue's, as any claim
// never sent: undone, not timed out.
func TestIntakeClaimNeverSentIsRescued(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	st := pgtest.New(t)
	res, err := st.IntakeApply(ctx, claimAll(intakeBatch(-1, 1, job("lost"))))
	if err != nil || len(res.Claimed) != 1 {
		t.Fatalf("claimed %v: %v", keysOf(res.Claimed), err)
	}
	unsent, _, err := st.AttemptFindUnsent(ctx, typeInfo, -time.Hour, 10, nil) // a grace that makes every claim lost
	if err != nil || len(unsent) != 1 || unsent[0].JobID != res.Claimed[0].ID {
		t.Fatalf("unsent %+v: %v", unsent, err)
	}
	if n, err := st.JobUndoClaim(ctx, []store.AttemptRef{unsent[0].AttemptRef}); err != nil || n != 1 {
		t.Fatalf("undone %d: %v", n, err)
	}
	wantState(t, get(t, st, "lost"), correlator.StateInitial, "", 0)
}

// A waiting job past its expiry is no due job that comes first: it will
// never be claimed (the sweeper ends it), so it does not keep a new due
// job of its queue from being claimed as it is stored.
func TestIntakeClaimsBesideAnExpiredWaitingJob(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	st := pgtest.New(t)
	past := time.Now().Add(-time.Minute)
	insert(t, st, job("expired", func(j *correlator.Job) { j.ScheduledRunTime = past.Add(-time.Hour); j.ExpiresAt = &past }))
	res, err := st.IntakeApply(ctx, claimAll(intakeBatch(-1, 1, job("new"))))
	if err != nil {
		t.Fatal(err)
	}
	if got := keysOf(res.Claimed); !slices.Equal(got, []string{"new"}) {
		t.Fatalf("claimed %v beside an expired waiting job, want the new one", got)
	}
}

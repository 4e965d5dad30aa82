package store_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// jobRow is what a bulk operation could change of a job.
type jobRow struct {
	ID                       int64
	Key, State, Outcome, Err string
	Attempt                  int
	Scheduled, Updated       time.Time
}

// jobRows reads the jobs where holds, by id.
func jobRows(t *testing.T, st *store.Store, where string, args ...any) map[int64]jobRow {
	t.Helper()
	rows, err := st.Pool().Query(ctx, `SELECT id, job_key, state, coalesce(outcome, ''), error, attempt, scheduled_run_time, update_time
		FROM hipq_job WHERE `+where, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[int64]jobRow{}
	for rows.Next() {
		var r jobRow
		if err := rows.Scan(&r.ID, &r.Key, &r.State, &r.Outcome, &r.Err, &r.Attempt, &r.Scheduled, &r.Updated); err != nil {
			t.Fatal(err)
		}
		out[r.ID] = r
	}
	return out
}

// runOperation creates an operation and works it to its end in batches of
// batch rows, as one owner.
func runOperation(t *testing.T, st *store.Store, op store.Operation, w store.OperationWork) store.Operation {
	t.Helper()
	w.Owner, w.Lease = "test", time.Minute
	created, err := st.OperationCreate(ctx, op, w.Owner, w.Lease)
	if err != nil {
		t.Fatal(err)
	}
	return workOperation(t, st, created.ID, w)
}

func workOperation(t *testing.T, st *store.Store, id int64, w store.OperationWork) store.Operation {
	t.Helper()
	for range 1000 {
		op, err := st.OperationStep(ctx, id, w)
		if err != nil {
			t.Fatalf("step of operation %d: %v", id, err)
		}
		if op.State != store.OperationRunning {
			return op
		}
	}
	t.Fatalf("operation %d did not end in 1000 steps", id)
	return store.Operation{}
}

func wantCounts(t *testing.T, op store.Operation, matched, done, skipped int64) {
	t.Helper()
	if op.State != store.OperationDone || op.Matched != matched || op.Done != done || op.Skipped != skipped {
		t.Fatalf("operation %d: %s, matched %d done %d skipped %d; want done, matched %d done %d skipped %d",
			op.ID, op.State, op.Matched, op.Done, op.Skipped, matched, done, skipped)
	}
}

// A bulk cancel cancels every non-final job its filter matches, running
// ones with their attempt, in batches, and touches no job outside the
// filter (other queue, type, key prefix, a final one, one created after
// it was asked); run again, it finds nothing to do. Its dry-run count is
// what it then matches.
func TestBulkCancelByFilter(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var jobs []*correlator.Job
	for i := range 12 {
		jobs = append(jobs, job(fmt.Sprintf("a-%d", i)))
	}
	jobs = append(jobs, job("b-1"), job("b-2"),
		job("a-other-queue", func(j *correlator.Job) { j.Queue, j.JobType = "other", "u" }),
		job("a-other-type", func(j *correlator.Job) { j.JobType = "u" }))
	insert(t, st, jobs...)
	running := claim(t, st, 3) // a-0, a-1, a-2 (the oldest due first)
	if _, err := st.JobCancel(ctx, "t", "a-11"); err != nil {
		t.Fatal(err)
	}
	now, err := st.DatabaseNow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	inFilter := `job_type = 't' AND queue = 'default' AND job_key LIKE 'a-%'`
	outside := jobRows(t, st, "NOT ("+inFilter+")")
	op := store.Operation{Kind: store.OperationCancel, Reason: "test", TokenName: "sha256:test",
		Jobs: &store.JobFilter{Queue: "default", JobType: "t", KeyPrefix: "a-", CreatedBefore: &now}}
	if n, err := st.OperationCount(ctx, op); err != nil || n != 11 {
		t.Fatalf("dry run: %d (%v), want 11 non-final jobs", n, err)
	}
	created, err := st.OperationCreate(ctx, op, "test", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	insert(t, st, job("a-late")) // asked for after: never walked
	got := workOperation(t, st, created.ID, store.OperationWork{Owner: "test", Lease: time.Minute, Batch: 4})
	wantCounts(t, got, 11, 11, 0)
	for _, r := range jobRows(t, st, inFilter+" AND job_key <> 'a-late'") {
		if r.State != "final" || r.Outcome != "cancelled" || r.Err != correlator.ErrorCancelled {
			t.Errorf("job %s: %s / %s (%s), want final / cancelled", r.Key, r.State, r.Outcome, r.Err)
		}
	}
	if j := get(t, st, "a-late"); j.State != correlator.StateInitial {
		t.Errorf("a job created after the operation was asked: %s", j.State)
	}
	for _, c := range running {
		if n := count(t, st, `SELECT count(*) FROM hipq_attempt WHERE job_id = $1 AND attempt = $2 AND outcome = 'cancelled'`,
			c.ID, c.Attempt); n != 1 {
			t.Errorf("running job %s: its attempt is not marked cancelled", c.JobKey)
		}
	}
	after := jobRows(t, st, "NOT ("+inFilter+")")
	for id, was := range outside {
		if now := after[id]; now != was {
			t.Errorf("job %s outside the filter changed: %+v, was %+v", was.Key, now, was)
		}
	}
	again := runOperation(t, st, op, store.OperationWork{Batch: 4})
	wantCounts(t, again, 0, 0, 0)
}

// A job that ends between the batch's read and its write (a reply, the
// sweeper) is left as it ended, and counted skipped.
func TestBulkCancelSkipsJobsEndedMeanwhile(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("k1"), job("k2"), job("k3"))
	k2 := get(t, st, "k2")
	// Another writer ends k2 and holds its row until told to commit.
	tx, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) // (committed below; a no-op then)
	if _, err := tx.Exec(ctx, `UPDATE hipq_job SET state = 'final', outcome = 'succeeded', update_time = now()
		WHERE queue = 'default' AND id = $1 AND state = 'initial' AND attempt = 0`, k2.ID); err != nil {
		t.Fatal(err)
	}
	now, _ := st.DatabaseNow(ctx)
	created, err := st.OperationCreate(ctx, store.Operation{Kind: store.OperationCancel, Reason: "test", TokenName: "x",
		Jobs: &store.JobFilter{Queue: "default", CreatedBefore: &now}}, "test", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		op  store.Operation
		err error
	}
	done := make(chan result, 1)
	go func() {
		op, err := st.OperationStep(ctx, created.ID, store.OperationWork{Owner: "test", Lease: time.Minute})
		done <- result{op, err}
	}()
	// The batch read k2 as initial and waits for its row.
	testutil.Eventually(t, 10*time.Second, func() bool {
		return count(t, st, waiting) > 0
	}, "the batch waits for k2's row")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	wantCounts(t, r.op, 3, 2, 1)
	wantState(t, get(t, st, "k2"), correlator.StateFinal, correlator.OutcomeSucceeded, 0)
	wantState(t, get(t, st, "k1"), correlator.StateFinal, correlator.OutcomeCancelled, 0)
}

// An operation cut short (its instance gone, its lease passed) is taken
// over by another store and goes on from its cursor: every job is acted on
// once, the counts add up, and the first worker can do nothing more. A
// stopped operation runs no further batch.
func TestBulkOperationResumesFromItsCursor(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var jobs []*correlator.Job
	for i := range 25 {
		jobs = append(jobs, job(fmt.Sprintf("k%02d", i), func(j *correlator.Job) { j.ScheduledRunTime = time.Now().Add(time.Hour) }))
	}
	insert(t, st, jobs...)
	now, _ := st.DatabaseNow(ctx)
	op, err := st.OperationCreate(ctx, store.Operation{Kind: store.OperationRunNow, Reason: "resume", TokenName: "x",
		Jobs: &store.JobFilter{JobType: "t", CreatedBefore: &now}}, "a", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	first := store.OperationWork{Owner: "a", Lease: time.Millisecond, Batch: 5}
	for range 2 {
		if op, err = st.OperationStep(ctx, op.ID, first); err != nil {
			t.Fatal(err)
		}
	}
	if k09 := get(t, st, "k09"); op.Done != 10 || op.Cursor != k09.ID {
		t.Fatalf("after two batches: done %d, cursor %d; want 10, %d (k09)", op.Done, op.Cursor, k09.ID)
	}
	// "a" dies holding it; another instance, on its own connections,
	// finds it once the lease has passed.
	other, err := store.Open(ctx, store.Config{URL: st.Pool().Config().ConnString()})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	testutil.Eventually(t, 10*time.Second, func() bool {
		ids, err := other.OperationsAbandoned(ctx)
		return err == nil && len(ids) == 1 && ids[0] == op.ID
	}, "the operation is abandoned")
	if ok, err := other.OperationTake(ctx, op.ID, "b", time.Minute); !ok || err != nil {
		t.Fatalf("take: %v %v", ok, err)
	}
	if ok, _ := st.OperationTake(ctx, op.ID, "c", time.Minute); ok {
		t.Fatal("a third instance took the operation b holds")
	}
	if _, err := st.OperationStep(ctx, op.ID, first); !errors.Is(err, store.ErrOperationLost) {
		t.Fatalf("a's step after b took over: %v, want ErrOperationLost", err)
	}
	second := store.OperationWork{Owner: "b", Lease: time.Minute, Batch: 5}
	if op, err = other.OperationStep(ctx, op.ID, second); err != nil || op.Done != 15 {
		t.Fatalf("b's first batch: done %d (%v), want 15", op.Done, err)
	}
	// Stopped: no batch after it.
	stopped, ok, err := st.OperationStop(ctx, op.ID)
	if err != nil || !ok || stopped.State != store.OperationStopped {
		t.Fatalf("stop: %+v %v %v", stopped, ok, err)
	}
	if _, err := other.OperationStep(ctx, op.ID, second); !errors.Is(err, store.ErrOperationLost) {
		t.Fatalf("a step of a stopped operation: %v", err)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_job WHERE scheduled_run_time <= now()`); n != 15 {
		t.Fatalf("%d jobs made due, want 15 (three batches of 5)", n)
	}
	// Taken again after the stop is undone: it ends, each job acted on once.
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_operation SET state = 'running' WHERE id = $1`, op.ID); err != nil {
		t.Fatal(err)
	}
	if ok, err := other.OperationTake(ctx, op.ID, "b", time.Minute); !ok || err != nil {
		t.Fatalf("take again: %v %v", ok, err)
	}
	wantCounts(t, workOperation(t, other, op.ID, second), 25, 25, 0)
	if _, _, err := st.OperationStop(ctx, op.ID); !errors.Is(err, store.ErrOperationEnded) {
		t.Fatalf("stop of a done operation: %v", err)
	}
}

// A bulk run-now makes waiting jobs due; one due already, running or final
// is not acted on; run again it does nothing more.
func TestBulkRunNow(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	later := func(j *correlator.Job) { j.ScheduledRunTime = time.Now().Add(time.Hour) }
	insert(t, st, job("due"), job("later-1", later), job("later-2", later))
	claim(t, st, 1) // "due" runs
	insert(t, st, job("due-2"))
	now, _ := st.DatabaseNow(ctx)
	op := store.Operation{Kind: store.OperationRunNow, Reason: "test", TokenName: "x", Jobs: &store.JobFilter{Queue: "default", CreatedBefore: &now}}
	wantCounts(t, runOperation(t, st, op, store.OperationWork{}), 3, 2, 1) // due-2 is due already
	for _, k := range []string{"later-1", "later-2"} {
		if j := get(t, st, k); j.ScheduledRunTime.After(time.Now()) || j.State != correlator.StateInitial {
			t.Errorf("%s: %s, due %v", k, j.State, j.ScheduledRunTime)
		}
	}
	wantState(t, get(t, st, "due"), correlator.StateRunning, "", 1)
	wantCounts(t, runOperation(t, st, op, store.OperationWork{}), 3, 0, 3)
}

// A bulk replay makes one new job per key whose newest job is final and in
// the filter: an older final job of a key, or a key with a non-final job,
// is skipped; the new job has the newest job's data; run again it makes
// no job.
func TestBulkReplayActsOnEachKeysNewestJob(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("twice"), job("live"), job("ok"), job("untouched"))
	cancel := func(k string) {
		t.Helper()
		if _, err := st.JobCancel(ctx, "t", k); err != nil {
			t.Fatal(err)
		}
	}
	replay := func(k string) {
		t.Helper()
		if _, err := st.JobReplay(ctx, "t", k, types["t"]); err != nil {
			t.Fatal(err)
		}
	}
	cancel("twice")
	insert(t, st, job("twice", func(j *correlator.Job) { j.JobData = json.RawMessage(`{"v":2}`) }))
	cancel("twice") // two final cancelled rows, the newer with other data
	cancel("live")
	replay("live") // final, then a non-final one
	cancel("ok")
	now, _ := st.DatabaseNow(ctx)
	op := store.Operation{Kind: store.OperationReplay, Reason: "test", TokenName: "x",
		Jobs: &store.JobFilter{State: correlator.StateFinal, Outcome: correlator.OutcomeCancelled, CreatedBefore: &now}}
	w := store.OperationWork{Types: typeInfo, Batch: 2}
	// twice (old, new), live (old), ok: new jobs of twice and ok.
	wantCounts(t, runOperation(t, st, op, w), 4, 2, 2)
	for _, k := range []string{"twice", "ok", "live"} {
		if j := get(t, st, k); j.State != correlator.StateInitial {
			t.Errorf("%s: the newest job is %s, want a new initial one", k, j.State)
		}
	}
	if j := get(t, st, "twice"); string(j.JobData) != `{"v": 2}` {
		t.Errorf("twice replayed with %s, want the newest job's data", j.JobData)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_job WHERE job_key = 'untouched'`); n != 1 {
		t.Errorf("a job outside the filter was replayed")
	}
	now, _ = st.DatabaseNow(ctx)
	op.Jobs.CreatedBefore = &now
	wantCounts(t, runOperation(t, st, op, w), 4, 0, 4)
	if n := count(t, st, `SELECT count(*) FROM hipq_job`); n != 8 {
		t.Errorf("%d jobs after the second run, want the 8 after the first", n)
	}
}

// A bulk dead-letter replay replays the unreplayed dead letters of its
// filter as single replays would: intake records become jobs, replies are
// applied, one refused again stays unreplayed (and is not dead-lettered a
// second time); dead letters outside the filter are left alone; run again
// it replays nothing more.
func TestBulkDeadLetterReplay(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("running"))
	c := claimSent(t, st, 1)
	old := time.Now().Add(-48 * time.Hour)
	dl := func(kind, reason, value string, received time.Time) store.DeadLetter {
		return store.DeadLetter{Kind: kind, Reason: reason, Source: store.Source{Topic: "x", Value: []byte(value), Received: received}}
	}
	if err := st.DeadLetterInsert(ctx, []store.DeadLetter{
		dl(store.SourceIntake, "unknown_job_type: t", `{"job_type": "t", "job_key": "n1"}`, time.Now()),
		dl(store.SourceIntake, "unknown_job_type: t", `{"job_type": "t", "job_key": "n2"}`, time.Now()),
		dl(store.SourceIntake, "unknown_job_type: nope", `{"job_type": "nope", "job_key": "n3"}`, time.Now()), // refused again
		dl(store.SourceReply, "unknown_job_type: t", fmt.Sprintf(`{"job_type": "t", "job_key": "running", "status": "succeeded", "attempt": %d}`, c[0].Attempt), time.Now()),
		dl(store.SourceIntake, "unknown_job_type: t", `{"job_type": "t", "job_key": "too-old"}`, old),
		dl(store.SourceIntake, "invalid_json: x", `{"job_type": "t", "job_key": "other-reason"}`, time.Now()),
	}); err != nil {
		t.Fatal(err)
	}
	decode := func(d store.DeadLetter) (*correlator.Job, *store.ReplyIn, error) {
		if d.Kind == store.SourceIntake {
			j, err := correlator.DecodeJob(d.Source.Value, 1<<20, typeInfo, time.Now())
			return j, nil, err
		}
		var r struct {
			Key     string `json:"job_key"`
			Attempt int    `json:"attempt"`
		}
		if err := json.Unmarshal(d.Source.Value, &r); err != nil {
			return nil, nil, err
		}
		in := reply(r.Key, r.Attempt, true)
		in.Kind, in.Source = d.Kind, d.Source
		return nil, &in, nil
	}
	since := time.Now().Add(-time.Hour)
	now, _ := st.DatabaseNow(ctx)
	op := store.Operation{Kind: store.OperationDeadLetterReplay, Reason: "fixed the config", TokenName: "x",
		DeadLetters: &store.DeadLetterFilter{ReasonPrefix: "unknown_job_type:", ReceivedAfter: &since, ReceivedBefore: &now}}
	w := store.OperationWork{Types: typeInfo, EarlyTTL: time.Minute, DecodeDeadLetter: decode, Batch: 3}
	if n, err := st.OperationCount(ctx, op); err != nil || n != 4 {
		t.Fatalf("dry run: %d (%v), want 4", n, err)
	}
	wantCounts(t, runOperation(t, st, op, w), 4, 3, 1)
	for _, k := range []string{"n1", "n2"} {
		if j := get(t, st, k); j.State != correlator.StateInitial {
			t.Errorf("%s: %s, want a new job", k, j.State)
		}
	}
	wantState(t, get(t, st, "running"), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	if n := count(t, st, `SELECT count(*) FROM hipq_dead_letter WHERE replayed_at IS NOT NULL`); n != 3 {
		t.Errorf("%d dead letters marked replayed, want 3", n)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_dead_letter`); n != 6 {
		t.Errorf("%d dead letters, want the 6 there were (none dead-lettered again)", n)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_job WHERE job_key IN ('too-old', 'other-reason')`); n != 0 {
		t.Errorf("a dead letter outside the filter was replayed")
	}
	now, _ = st.DatabaseNow(ctx)
	op.DeadLetters.ReceivedBefore = &now
	wantCounts(t, runOperation(t, st, op, w), 1, 0, 1)
}

// Operations are kept for reading: GetOperation returns what OperationStep
// returned; an unknown id is ErrNotFound.
func TestOperationGet(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	now, _ := st.DatabaseNow(ctx)
	op := runOperation(t, st, store.Operation{Kind: store.OperationCancel, Reason: "r", TokenName: "sha256:0123abcd",
		Jobs: &store.JobFilter{KeyPrefix: "x", CreatedBefore: &now}}, store.OperationWork{})
	got, err := st.OperationGet(ctx, op.ID)
	if err != nil || got.State != store.OperationDone || got.TokenName != "sha256:0123abcd" || got.Jobs.KeyPrefix != "x" ||
		!got.Jobs.CreatedBefore.Equal(now) {
		t.Fatalf("get: %+v %v", got, err)
	}
	if _, err := st.OperationGet(ctx, op.ID+1); !errors.Is(err, correlator.ErrNotFound) {
		t.Fatalf("get of no operation: %v", err)
	}
}

// A bulk cancel writes each cancelled job's outcome event in the batch
// that ends it, as a single cancel does; a job it skips gets none.
func TestBulkCancelWritesOutcomeEvents(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t).WithEvents(store.EventsOf(eventTypes()))
	insert(t, st, job("a-1"), job("a-2"), job("a-3"), job("b-1"))
	now, err := st.DatabaseNow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	op := store.Operation{Kind: store.OperationCancel, Reason: "test", TokenName: "sha256:test",
		Jobs: &store.JobFilter{Queue: "default", KeyPrefix: "a-", CreatedBefore: &now}}
	got := runOperation(t, st, op, store.OperationWork{Batch: 2})
	wantCounts(t, got, 3, 3, 0)
	if n := count(t, st, `SELECT count(*) FROM hipq_event e JOIN hipq_job j ON j.queue = e.queue AND j.id = e.job_id
		WHERE e.topic = 'ev' AND e.outcome = 'cancelled' AND j.job_key LIKE 'a-%' AND j.outcome = 'cancelled'`); n != 3 {
		t.Fatalf("%d outcome events of 3 cancelled jobs", n)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_event`); n != 3 {
		t.Fatalf("%d events in all, want the 3 cancelled jobs'", n)
	}
}

// Operations that ended are pruned once older than the retention; one
// still running never is.
func TestOperationPrune(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a-1"))
	now, err := st.DatabaseNow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	op := store.Operation{Kind: store.OperationCancel, Reason: "test", TokenName: "sha256:test",
		Jobs: &store.JobFilter{KeyPrefix: "a-", CreatedBefore: &now}}
	runOperation(t, st, op, store.OperationWork{Batch: 10})
	if _, err := st.OperationCreate(ctx, op, "test", time.Minute); err != nil { // (running)
		t.Fatal(err)
	}
	if n, err := st.OperationPrune(ctx, time.Hour, 10); err != nil || n != 0 {
		t.Fatalf("pruned %d (%v) within the retention", n, err)
	}
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_operation SET updated_at = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	if n, err := st.OperationPrune(ctx, time.Hour, 10); err != nil || n != 1 {
		t.Fatalf("pruned %d (%v), want the one that ended", n, err)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_operation WHERE state = 'running'`); n != 1 {
		t.Fatalf("%d running operations left, want 1", n)
	}
}

package store_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
)

// Issue 9.9: a job that goes final at once after its insert (a fast sync
// downstream, a cancel, an expiry; here a trigger) is still one job: the
// enqueue decides by its insert, never by a read that comes after it.
func TestEnqueueOfAJobThatEndsAtOnceIsOneJob(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test ends the job in the way with a trigger, which Citus refuses on a distributed table")
	t.Parallel()
	st := pgtest.New(t)
	if _, err := st.Pool().Exec(ctx, `
		CREATE FUNCTION end_at_once() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN UPDATE hipq_job SET state = 'final', outcome = 'succeeded' WHERE id = NEW.id; RETURN NULL; END $$;
		CREATE TRIGGER end_at_once AFTER INSERT ON hipq_job FOR EACH ROW WHEN (NEW.job_key = 'instant')
		EXECUTE FUNCTION end_at_once();`); err != nil {
		t.Fatal(err)
	}
	j, created, err := st.JobEnqueue(ctx, job("instant"))
	if err != nil || !created || j.JobKey != "instant" {
		t.Fatalf("enqueue: created %v, err %v", created, err)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_job WHERE job_key = 'instant'`); n != 1 {
		t.Fatalf("one enqueue made %d jobs", n)
	}
}

// Issue 9.9: an intake record with other job_data than the non-final job
// of its key is a conflict, even when that job goes final right after the
// insert met it (here a trigger at the end of the insert statement).
func TestIntakeConflictDecidedOnOneSnapshot(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test moves the job in the way with a trigger, which Citus refuses on a distributed table (and there the insert and the lookup are two statements: see jobsInsertDistributed)")
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("racy"))
	if _, err := st.Pool().Exec(ctx, `
		CREATE FUNCTION end_racy() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN UPDATE hipq_job SET state = 'final', outcome = 'cancelled', error = 'cancelled' WHERE job_key = 'racy' AND state <> 'final';
		RETURN NULL; END $$;
		CREATE TRIGGER end_racy AFTER INSERT ON hipq_job FOR EACH STATEMENT EXECUTE FUNCTION end_racy();`); err != nil {
		t.Fatal(err)
	}
	other := job("racy", func(j *correlator.Job) { j.JobData = json.RawMessage(`{"other": true}`) })
	res, err := st.IntakeApply(ctx, intakeBatch(-1, 1, other))
	if err != nil {
		t.Fatal(err)
	}
	if res.Inserted != 0 || res.Duplicates != 0 || len(res.DeadLetters) != 1 || !strings.HasPrefix(res.DeadLetters[0].Reason, correlator.CodeConflict) {
		t.Fatalf("inserted %d, duplicates %d, dead letters %+v: want one conflict", res.Inserted, res.Duplicates, res.DeadLetters)
	}
}

// A reply to a job whose time windows this build cannot read (a zone its
// time zone data lacks) is applied all the same; the retry it schedules
// leaves the windows to the claim, which reads them in PostgreSQL.
func TestReplyToAJobWithUnreadableWindows(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("w"))
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET time_windows = '[{"start":"00:00","end":"00:00","tz":"Mars/Olympus_Mons"}]'`); err != nil {
		t.Fatal(err)
	}
	claim(t, st, 1)
	res := applyReplies(t, st, reply("w", 1, false))
	if res.Counts()[correlator.Apply] != 1 {
		t.Fatalf("counts %v", res.Counts())
	}
	wantState(t, get(t, st, "w"), correlator.StateRetry, "", 1)
}

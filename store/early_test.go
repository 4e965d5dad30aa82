package store_test

import (
	"testing"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// An early reply is kept under its job's queue when it has a job (one not
// dispatched yet: here of type t in queue other, as after the type moved),
// else under its type's queue in the config; each then applies when its
// job is sent, on one PostgreSQL and on Citus (where it is read from that
// queue's shard beside the job).
func TestEarlyRepliesKeepTheirJobsQueue(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("waiting", func(j *correlator.Job) { j.Queue = "other" }))
	res := applyReplies(t, st, reply("nojob", 0, true), reply("waiting", 1, true))
	if n := res.Counts()[correlator.Early]; n != 2 {
		t.Fatalf("%d replies kept, want 2: %v", n, res.Verdicts)
	}
	for key, queue := range map[string]string{"nojob": "default", "waiting": "other"} {
		if n := count(t, st, "SELECT count(*) FROM hipq_early_reply WHERE job_key = $1 AND queue = $2", key, queue); n != 1 {
			t.Errorf("early reply of %s: not kept under queue %s", key, queue)
		}
	}
	insert(t, st, job("nojob"))
	var refs []store.AttemptRef
	for _, q := range []string{"default", "other"} {
		c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: q, Limit: 10, Instance: "test"})
		if err != nil || len(c.Jobs) != 1 {
			t.Fatalf("claim %s: %d jobs (%v), want 1", q, len(c.Jobs), err)
		}
		refs = append(refs, c.Jobs[0].Ref())
	}
	applyEarlyReplies(t, st, refs, "nojob", "waiting")
}

// applyEarlyReplies applies the kept replies of the attempts refs (sent
// jobs): each of keys ends succeeded, and none is left kept.
func applyEarlyReplies(t *testing.T, st *store.Store, refs []store.AttemptRef, keys ...string) {
	t.Helper()
	res, err := st.EarlyReplyApply(ctx, refs, typeInfo)
	if err != nil || len(res.Applied) != len(keys) {
		t.Fatalf("early replies applied: %+v (%v), want %d", res, err, len(keys))
	}
	for _, k := range keys {
		wantState(t, get(t, st, k), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_early_reply"); n != 0 {
		t.Fatalf("%d early replies left once applied", n)
	}
}

// Version 24 gives the early replies an older hipq kept the queue of the
// job they name (by job id, else the non-final job of their type and key)
// and leaves the others without one; every one of them still matches its
// job on one PostgreSQL, and a new reply is kept with its queue.
func TestMigrationGivesEarlyRepliesTheirQueue(t *testing.T) {
	t.Parallel()
	pgtest.SkipOnCitus(t, "it stands for a database before version 24 by dropping hipq_early_reply.queue, the distribution column there")
	st := pgtest.New(t)
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := st.Pool().Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	insert(t, st, job("by-id", func(j *correlator.Job) { j.Queue = "q2" }), job("by-key", func(j *correlator.Job) { j.Queue = "q3" }))
	byID := get(t, st, "by-id")
	// As an older hipq left them: no queue column; a reply by job id, one
	// by the key of a waiting job, one whose job does not exist yet.
	exec("ALTER TABLE hipq_early_reply DROP COLUMN queue")
	exec(`INSERT INTO hipq_early_reply (job_type, job_key, job_id, attempt, success, retryable, reply, topic, expires_at)
		VALUES ('', '', $1, 1, true, true, '{}', 'r', now() + interval '1 hour'),
		       ('t', 'by-key', NULL, 1, true, true, '{}', 'r', now() + interval '1 hour'),
		       ('t', 'soon', NULL, NULL, true, true, '{}', 'r', now() + interval '1 hour')`, byID.ID)
	exec("DELETE FROM hipq_schema_migration WHERE version >= 24")
	if _, err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for q, want := range map[string]int{
		"SELECT count(*) FROM hipq_early_reply WHERE job_id IS NOT NULL AND queue = 'q2'": 1,
		"SELECT count(*) FROM hipq_early_reply WHERE job_key = 'by-key' AND queue = 'q3'": 1,
		"SELECT count(*) FROM hipq_early_reply WHERE job_key = 'soon' AND queue IS NULL":  1,
	} {
		if n := count(t, st, q); n != want {
			t.Errorf("%s: %d, want %d", q, n, want)
		}
	}
	// Each matches its job once it is sent, the one without a queue too.
	insert(t, st, job("soon"))
	var refs []store.AttemptRef
	for _, q := range []string{"default", "q2", "q3"} {
		c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: q, Limit: 10, Instance: "test"})
		if err != nil || len(c.Jobs) != 1 {
			t.Fatalf("claim %s: %d jobs (%v), want 1", q, len(c.Jobs), err)
		}
		refs = append(refs, c.Jobs[0].Ref())
	}
	res, err := st.EarlyReplyApply(ctx, refs, typeInfo)
	if err != nil || len(res.Applied) != 3 {
		t.Fatalf("early replies applied: %+v (%v), want 3", res, err)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_early_reply"); n != 0 {
		t.Fatalf("%d early replies left once applied", n)
	}
	applyReplies(t, st, reply("later", 0, true))
	if n := count(t, st, "SELECT count(*) FROM hipq_early_reply WHERE job_key = 'later' AND queue = 'default'"); n != 1 {
		t.Fatal("a reply kept after the migration has no queue")
	}
}

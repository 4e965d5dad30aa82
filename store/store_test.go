package store_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

func TestMigrateIdempotentAndRefusesNewerSchema(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	applied, err := st.Migrate(ctx)
	if err != nil || len(applied) != 0 {
		t.Fatalf("second migrate applied %v, err %v", applied, err)
	}
	if err := st.CheckSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, "INSERT INTO hipq_schema_migration (version, name) VALUES (999, 'future')"); err != nil {
		t.Fatal(err)
	}
	var tooNew *store.ErrSchemaTooNew
	if _, err := st.Migrate(ctx); !errors.As(err, &tooNew) {
		t.Fatalf("migrate on a newer schema: %v", err)
	}
	if err := st.CheckSchema(ctx); !errors.As(err, &tooNew) {
		t.Fatalf("check on a newer schema: %v", err)
	}
}

// A migration run outside a transaction (CREATE INDEX CONCURRENTLY, so an
// index over a big table never stops the writes) that a crash cut short
// is run again whole: unrecorded, with the old index still there and an
// invalid half-built new one, it ends with the new index valid and the old
// one gone.
func TestMigrateNoTransactionRunsAgain(t *testing.T) {
	t.Parallel()
	if pgtest.OnCitus() {
		t.Skip("runs version 11 again over a failed unique build of (job_type, job_key): on Citus a unique key must include queue, and the tables are distributed only after the latest migration, so version 11 never runs over them")
	}
	st := pgtest.New(t)
	ms, err := store.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	var m store.Migration
	for _, x := range ms {
		if x.NoTransaction() && strings.Contains(x.SQL, "hipq_job_final_key") {
			m = x // the index build
		}
	}
	if m.Version == 0 || len(m.Statements()) < 2 {
		t.Fatalf("no migration runs outside a transaction (or it is one statement): %+v", m)
	}
	// As if cut short after the new index's build failed: unrecorded, the
	// old index back, the new one invalid (a duplicate key fails a unique
	// build, which CONCURRENTLY leaves behind invalid).
	for _, q := range []string{
		"DELETE FROM hipq_schema_migration WHERE version >= " + fmt.Sprint(m.Version),
		"CREATE INDEX hipq_job_key ON hipq_job (job_type, job_key, id)",
		"DROP INDEX hipq_job_final_key",
		"INSERT INTO hipq_job (queue, job_type, job_key, state, outcome) VALUES ('q', 't', 'dup', 'final', 'succeeded'), ('q', 't', 'dup', 'final', 'succeeded')",
	} {
		if _, err := st.Pool().Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := st.Pool().Exec(ctx, "CREATE UNIQUE INDEX CONCURRENTLY hipq_job_final_key ON hipq_job (job_type, job_key) WHERE state = 'final'"); err == nil {
		t.Fatal("the unique build did not fail")
	}
	valid := func(index string) (exists, ok bool) {
		err := st.Pool().QueryRow(ctx, `SELECT true, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
			WHERE c.relname = $1 AND c.relnamespace = current_schema()::regnamespace`, index).Scan(&exists, &ok)
		if err != nil && err.Error() != "no rows in result set" {
			t.Fatal(err)
		}
		return exists, ok
	}
	if e, ok := valid("hipq_job_final_key"); !e || ok {
		t.Fatalf("the setup left no invalid index (exists %v, valid %v)", e, ok)
	}
	applied, err := st.Migrate(ctx)
	if err != nil || len(applied) == 0 || applied[0].Version != m.Version {
		t.Fatalf("migrate again: applied %v, %v", applied, err)
	}
	if e, ok := valid("hipq_job_final_key"); !e || !ok {
		t.Fatalf("hipq_job_final_key: exists %v, valid %v", e, ok)
	}
	if e, _ := valid("hipq_job_key"); e {
		t.Fatal("the old index is still there")
	}
}

// Version 13 gives the attempt rows of an older build their job's queue
// (claims made before it have none) in batches of job ids, keeps an
// attempt a claim still running the old function commits meanwhile, drops
// the attempts of no job, and from then on every attempt has a queue: a
// claim writes it. Its statements are run one by one here, so that such a
// late attempt can come between them.
func TestMigrationGivesAttemptsTheirQueue(t *testing.T) {
	t.Parallel()
	if pgtest.OnCitus() {
		t.Skip(skipBeforeVersion13)
	}
	st := pgtest.New(t)
	insert(t, st, job("old"), job("new"))
	c := claim(t, st, 1)
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := st.Pool().Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	// As an older build left them: no queue column, jobs whose ids span
	// several batches, one orphan attempt.
	exec("ALTER TABLE hipq_attempt DROP COLUMN queue")
	exec(`INSERT INTO hipq_job (id, queue, job_type, job_key, state, attempt) OVERRIDING SYSTEM VALUE
		VALUES (50000, 'q2', 't', 'far', 'running', 1), (90000, 'q3', 't', 'farther', 'running', 1)`)
	exec("INSERT INTO hipq_attempt (job_id, attempt, instance) VALUES (50000, 1, 'i'), (90000, 1, 'i'), (-1, 1, 'gone')")
	exec("DELETE FROM hipq_schema_migration WHERE version >= 13")
	ms, err := store.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	var m store.Migration
	for _, x := range ms {
		if x.Version == 13 {
			m = x
		}
	}
	if !m.NoTransaction() {
		t.Fatalf("version 13 (%q) does not run outside a transaction", m.Name)
	}
	unfilled := "SELECT count(*) FROM hipq_attempt a WHERE a.queue IS NULL AND EXISTS (SELECT 1 FROM hipq_job j WHERE j.id = a.job_id)"
	late := false
	for _, q := range m.Statements() {
		exec(q)
		switch {
		case strings.HasPrefix(q, "DO $$") && strings.Contains(q, "WHILE"):
			if n := count(t, st, unfilled); n != 0 {
				t.Fatalf("the batched fill left %d attempts without their queue", n)
			}
		case strings.HasPrefix(q, "UPDATE hipq_attempt") && !late:
			// A claim still running the old function commits its attempt.
			exec("INSERT INTO hipq_attempt (job_id, attempt, instance) VALUES (90000, 2, 'late')")
			late = true
		}
	}
	exec("INSERT INTO hipq_schema_migration (version, name) VALUES (13, 'again')")
	if _, err := st.Migrate(ctx); err != nil { // the versions after it
		t.Fatal(err)
	}
	for _, w := range []struct {
		q    string
		args []any
		want int
	}{
		{"SELECT count(*) FROM hipq_attempt WHERE job_id = $1 AND queue = 'default'", []any{c[0].ID}, 1},
		{"SELECT count(*) FROM hipq_attempt WHERE job_id = 50000 AND queue = 'q2'", nil, 1},
		{"SELECT count(*) FROM hipq_attempt WHERE job_id = 90000 AND queue = 'q3'", nil, 2}, // the late one kept
		{"SELECT count(*) FROM hipq_attempt WHERE job_id = -1", nil, 0},
		{"SELECT count(*) FROM pg_constraint WHERE conname = 'hipq_attempt_queue_set'", nil, 0},
	} {
		if n := count(t, st, w.q, w.args...); n != w.want {
			t.Errorf("%s: %d, want %d", w.q, n, w.want)
		}
	}
	c = claim(t, st, 1)
	if n := count(t, st, "SELECT count(*) FROM hipq_attempt WHERE job_id = $1 AND queue = 'default'", c[0].ID); n != 1 {
		t.Fatalf("a new claim's attempt has no queue (%d rows)", n)
	}
	if _, err := st.Pool().Exec(ctx, "INSERT INTO hipq_attempt (job_id, attempt, instance) VALUES (-2, 1, 'x')"); err == nil {
		t.Fatal("an attempt without a queue was accepted")
	}
}

// Invariant 1: at most one non-final job per (type, key).
func TestOneNonFinalJobPerKey(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"))
	if _, err := st.Pool().Exec(ctx, `INSERT INTO hipq_job (queue, job_type, job_key) VALUES ('default', 't', 'a')`); err == nil {
		t.Fatal("a second non-final job for one key was accepted")
	}
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET state = 'final', outcome = 'cancelled' WHERE job_key = 'a'`); err != nil {
		t.Fatal(err)
	}
	if n, err := st.JobsInsert(ctx, []*correlator.Job{job("a")}); err != nil || n != 1 {
		t.Fatalf("a key whose jobs are all final makes a new job: n=%d err=%v", n, err)
	}
}

// One non-final job per (type, key) is kept, on Citus, per queue: a type
// must not move to another queue while it has non-final jobs. The store
// counts a type's non-final jobs outside its configured queue, by queue;
// its final jobs and the jobs in its configured queue do not count.
func TestNonFinalElsewhere(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	in := func(queue string) func(*correlator.Job) { return func(j *correlator.Job) { j.Queue = queue } }
	u := func(j *correlator.Job) { j.JobType = "u" }
	insert(t, st, job("a", in("old")), job("b", in("old")), job("c", in("old")), job("d", in("older")),
		job("e", in("new")), job("f", in("old")), job("g", in("old"), u))
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET state = 'final', outcome = 'cancelled' WHERE job_key = 'f'`); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET state = 'running', attempt = 1, started_at = now() WHERE job_key = 'a'`); err != nil {
		t.Fatal(err)
	}
	got, err := st.NonFinalElsewhere(ctx, map[string]string{"t": "new", "u": "old", "gone": "x"})
	if err != nil {
		t.Fatal(err)
	}
	want := []store.JobsElsewhere{{JobType: "t", Queue: "old", Count: 3}, {JobType: "t", Queue: "older", Count: 1}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if got, err := st.NonFinalElsewhere(ctx, map[string]string{"u": "new"}); err != nil || fmt.Sprint(got) != "[{u old 1}]" {
		t.Fatalf("type u moved to new: got %v, %v, want [{u old 1}]", got, err)
	}
	if got, err := st.NonFinalElsewhere(ctx, map[string]string{"u": "old"}); err != nil || len(got) != 0 {
		t.Fatalf("type u kept in its queue: got %v, %v, want none", got, err)
	}
}

func intakeBatch(from, to int64, jobs ...*correlator.Job) store.IntakeBatch {
	b := store.IntakeBatch{Group: "g", Offsets: []store.OffsetAdvance{{Topic: "in", Partition: 0, From: from, To: to}}}
	for i, j := range jobs {
		b.Jobs = append(b.Jobs, store.IntakeJob{Job: j, Source: store.Source{Topic: "in", Offset: from + int64(i), Value: []byte(j.JobKey)}})
	}
	return b
}

func TestIntakeDuplicatesAndConflicts(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	res, err := st.IntakeApply(ctx, intakeBatch(-1, 2, job("a"), job("b")))
	if err != nil || res.Inserted != 2 {
		t.Fatalf("res %+v err %v", res, err)
	}
	other := job("b", func(j *correlator.Job) { j.JobData = []byte(`{"other":true}`) })
	same := job("a", func(j *correlator.Job) { j.JobData = []byte(`{ "k" : "a" }`) }) // same JSON, other spelling
	res, err = st.IntakeApply(ctx, intakeBatch(2, 4, same, other))
	if err != nil {
		t.Fatal(err)
	}
	if res.Inserted != 0 || res.Duplicates != 1 || len(res.DeadLetters) != 1 {
		t.Fatalf("got %+v, want one duplicate and one conflict", res)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_dead_letter WHERE source = 'intake' AND reason LIKE 'conflict: %'"); n != 1 {
		t.Fatalf("%d conflict dead letters, want 1", n)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_job"); n != 2 {
		t.Fatalf("%d jobs, want 2", n)
	}
}

// Invariant 7: offsets advance by compare-and-set in the effect's
// transaction; a batch applied twice takes effect once.
func TestOffsetCompareAndSet(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	if _, err := st.IntakeApply(ctx, intakeBatch(-1, 1, job("a"))); err != nil {
		t.Fatal(err)
	}
	for _, from := range []int64{-1, 0, 5} {
		if _, err := st.IntakeApply(ctx, intakeBatch(from, 2, job("x"))); !errors.Is(err, store.ErrOffsetConflict) {
			t.Fatalf("from %d: got %v, want ErrOffsetConflict", from, err)
		}
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_job"); n != 1 {
		t.Fatalf("a refused batch wrote jobs: %d", n)
	}
	got, err := st.OffsetsLoad(ctx, "g", []store.TopicPartition{{Topic: "in", Partition: 0}, {Topic: "in", Partition: 1}})
	if err != nil || len(got) != 1 || got[store.TopicPartition{Topic: "in"}] != 1 {
		t.Fatalf("offsets %v, err %v", got, err)
	}

	// Two consumers (one lost the partition in a rebalance) apply the same
	// records at once: exactly one takes effect.
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = st.IntakeApply(ctx, intakeBatch(1, 3, job("b"), job("c")))
		}()
	}
	wg.Wait()
	ok := 0
	for _, err := range errs {
		switch {
		case err == nil:
			ok++
		case !errors.Is(err, store.ErrOffsetConflict):
			t.Fatal(err)
		}
	}
	if ok != 1 {
		t.Fatalf("%d concurrent applies took effect, want 1", ok)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_job"); n != 3 {
		t.Fatalf("%d jobs, want 3", n)
	}
}

// Claims are exclusive across concurrent dispatchers; expired and future
// jobs are not claimed; attempt and update_time move (invariants 2, 4).
func TestClaim(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var jobs []*correlator.Job
	for i := range 40 {
		jobs = append(jobs, job(fmt.Sprintf("j%d", i)))
	}
	past := time.Now().Add(-time.Minute)
	insert(t, st, jobs...)
	insert(t, st, job("expired", func(j *correlator.Job) { j.ExpiresAt = &past }),
		job("future", func(j *correlator.Job) { j.ScheduledRunTime = time.Now().Add(time.Hour) }))
	before := get(t, st, "j0").UpdateTime
	var wg sync.WaitGroup
	var mu sync.Mutex
	seen := map[int64]int{}
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 7, Instance: "i"})
				if err != nil {
					t.Error(err)
					return
				}
				if len(c.Jobs) == 0 {
					return
				}
				mu.Lock()
				for _, j := range c.Jobs {
					seen[j.ID]++
					if j.Attempt != 1 {
						t.Errorf("claimed attempt %d", j.Attempt)
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(seen) != 40 {
		t.Fatalf("claimed %d jobs, want 40", len(seen))
	}
	for id, n := range seen {
		if n != 1 {
			t.Fatalf("job %d claimed %d times", id, n)
		}
	}
	a := get(t, st, "j0")
	wantState(t, a, correlator.StateRunning, "", 1)
	if !a.UpdateTime.After(before) || a.StartedAt == nil {
		t.Errorf("update_time %v (before %v), started_at %v", a.UpdateTime, before, a.StartedAt)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_attempt WHERE attempt = 1 AND instance = 'i' AND sent_at IS NULL"); n != 40 {
		t.Fatalf("%d attempt rows, want 40", n)
	}
	wantState(t, get(t, st, "expired"), correlator.StateInitial, "", 0)
	wantState(t, get(t, st, "future"), correlator.StateInitial, "", 0)
}

// Invariant 8: an undone claim restores state, attempt and the previous
// error, and deletes its attempt row; a sent claim is never undone.
func TestUndoClaim(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"), job("b"))
	c := claim(t, st, 10)
	refs := []store.AttemptRef{c[0].Ref(), c[1].Ref()}
	if err := st.AttemptMarkSent(ctx, refs[1:]); err != nil {
		t.Fatal(err)
	}
	n, err := st.JobUndoClaim(ctx, refs)
	if err != nil || n != 1 {
		t.Fatalf("undone %d, err %v; want 1 (the sent one stays)", n, err)
	}
	a := get(t, st, c[0].JobKey)
	wantState(t, a, correlator.StateInitial, "", 0)
	if a.Error != correlator.ErrorNone || a.StartedAt != nil {
		t.Errorf("error %q started_at %v", a.Error, a.StartedAt)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_attempt WHERE job_id = $1", c[0].ID); n != 0 {
		t.Fatalf("attempt row kept")
	}

	// A job in retry: the undo brings back its last attempt's error.
	applyReplies(t, st, reply(c[1].JobKey, 1, false))
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_job SET scheduled_run_time = now() - interval '1s' WHERE id = $1", c[1].ID); err != nil {
		t.Fatal(err)
	}
	c2 := claim(t, st, 10)
	var again store.Claimed
	for _, x := range c2 {
		if x.ID == c[1].ID {
			again = x
		}
	}
	if again.Attempt != 2 {
		t.Fatalf("reclaimed attempt %d, want 2", again.Attempt)
	}
	if n, _ := st.JobUndoClaim(ctx, []store.AttemptRef{again.Ref()}); n != 1 {
		t.Fatal("retry claim not undone")
	}
	b := get(t, st, c[1].JobKey)
	wantState(t, b, correlator.StateRetry, "", 1)
	if b.Error != "nope" {
		t.Errorf("error %q, want the last attempt's", b.Error)
	}
}

// Invariant 3 and the guards: a write for another attempt, or on a final
// job, changes nothing.
func TestResolveIsGuarded(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"))
	c := claim(t, st, 1)[0]
	final := correlator.Replied(nil, c.Running(), &correlator.Reply{Success: true}, time.Now())
	done, err := st.JobResolveMany(ctx, []store.Resolve{{Queue: c.Queue, JobID: c.ID, Attempt: 2, Res: final}})
	if err != nil || len(done) != 0 {
		t.Fatalf("a write for attempt 2 took effect on attempt 1: %v %v", done, err)
	}
	done, _ = st.JobResolveMany(ctx, []store.Resolve{{Queue: c.Queue, JobID: c.ID, Attempt: 1, Res: final}})
	if len(done) != 1 {
		t.Fatal("the right write did not take effect")
	}
	before := get(t, st, "a")
	failed := correlator.Replied(nil, c.Running(), &correlator.Reply{Error: "x"}, time.Now())
	done, _ = st.JobResolveMany(ctx, []store.Resolve{{Queue: c.Queue, JobID: c.ID, Attempt: 1, Res: failed}})
	after := get(t, st, "a")
	if len(done) != 0 || after.Outcome != correlator.OutcomeSucceeded || !after.UpdateTime.Equal(before.UpdateTime) {
		t.Fatalf("a final job changed: %+v", after)
	}
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_job SET attempt = 9 WHERE id = $1", c.ID); err == nil {
		t.Fatal("attempt above max_attempts was accepted by the table")
	}
}

// waiting counts this database's sessions waiting for a lock (pg_locks is
// the cluster's: other tests' waits are not these).
//
// On Citus the writer waits on the worker holding the job's shard, for
// the coordinator's transaction that holds it: Citus's own view of those
// waits, citus_lock_waits, counts them.
var waiting = func() string {
	if pgtest.OnCitus() {
		return `SELECT count(*) FROM citus_lock_waits`
	}
	return `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`
}()

// Every transaction that writes attempt rows takes their jobs' locks
// first, in id order: a sent mark, an undo, a delivery or the send spans'
// contexts waiting for a job
// another transaction holds holds no attempt row meanwhile (so the order
// in which a plan reaches attempt rows never matters: writers of the same
// attempts wait in turn, never in a cycle; marks that took attempt rows
// alone deadlocked with replies, a second's stall each), but holds the
// lower job.
func TestAttemptWritersLockJobsFirst(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("x1"), job("y1"), job("x2"), job("y2"), job("x3"), job("y3"), job("x4"), job("y4"))
	c := claim(t, st, 8)
	for i, write := range []func(x, y store.Claimed) error{
		func(x, y store.Claimed) error { return st.AttemptMarkSent(ctx, []store.AttemptRef{y.Ref(), x.Ref()}) },
		func(x, y store.Claimed) error {
			_, err := st.DeliveryRecord(ctx, store.Delivery{Sent: []store.AttemptRef{y.Ref(), x.Ref()}}, typeInfo)
			return err
		},
		func(x, y store.Claimed) error {
			_, err := st.JobUndoClaim(ctx, []store.AttemptRef{y.Ref(), x.Ref()})
			return err
		},
		func(x, y store.Claimed) error {
			return st.AttemptTracesWrite(ctx, []store.AttemptTrace{{AttemptRef: y.Ref(), Parent: "p"}, {AttemptRef: x.Ref(), Parent: "p"}})
		},
	} {
		x, y := c[2*i], c[2*i+1]
		if x.ID > y.ID {
			x, y = y, x
		}
		holder, err := st.Pool().Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer holder.Rollback(ctx) // (a failed check leaves it open)
		if _, err := holder.Exec(ctx, "SELECT 1 FROM hipq_job WHERE queue = 'default' AND id = $1 FOR UPDATE", y.ID); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- write(x, y) }()
		testutil.Eventually(t, 10*time.Second, func() (bool, string) {
			if count(t, st, waiting) > 0 {
				return true, ""
			}
			select {
			case err := <-done:
				t.Fatalf("writer %d ended without waiting for the held job: %v", i, err)
			default:
			}
			return false, "not waiting"
		}, "writer %d to wait for the held job", i)
		if _, err := holder.Exec(ctx, "SELECT 1 FROM hipq_attempt WHERE queue = 'default' AND job_id = $1 FOR UPDATE NOWAIT", x.ID); err != nil {
			t.Errorf("writer %d holds job %d's attempt while it waits for job %d: %v", i, x.ID, y.ID, err)
		}
		if _, err := holder.Exec(ctx, "SELECT 1 FROM hipq_job WHERE queue = 'default' AND id = $1 FOR UPDATE NOWAIT", x.ID); err == nil {
			t.Errorf("writer %d waits for job %d without holding job %d, the lower one", i, y.ID, x.ID)
		}
		_ = holder.Rollback(ctx)
		if err := <-done; err != nil {
			t.Fatalf("writer %d: %v", i, err)
		}
	}
}

// A statement_timeout of the store's connections (or of the role, or the
// URL) does not bound a migration: version 13's batched fill of 100,000
// attempts outlasts 100 ms and still completes.
func TestMigrationOutlastsStatementTimeout(t *testing.T) {
	t.Parallel()
	url, st := beforeVersion13(t,
		`WITH j AS (INSERT INTO hipq_job (queue, job_type, job_key, state, outcome, attempt)
		   SELECT 'q', 't', 'k' || i, 'final', 'succeeded', 1 FROM generate_series(1, 100000) i RETURNING id)
		 INSERT INTO hipq_attempt (job_id, attempt, instance) SELECT id, 1, 'i' FROM j`)
	bounded, err := store.Open(ctx, store.Config{URL: url, StatementTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer bounded.Close()
	if applied, err := bounded.Migrate(ctx); err != nil || len(applied) == 0 || applied[0].Version != 13 {
		t.Fatalf("migrate under a 100 ms statement timeout: %v %v", applied, err)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_attempt WHERE queue = 'q'"); n != 100000 {
		t.Fatalf("%d attempts have their queue", n)
	}
	// The connection is back to its own timeout.
	var timeout string
	if err := bounded.Pool().QueryRow(ctx, "SHOW statement_timeout").Scan(&timeout); err != nil || timeout != "100ms" {
		t.Fatalf("statement_timeout after the migration: %q %v", timeout, err)
	}
}

// A migration's ALTER TABLE queued behind a long transaction blocks every
// statement on the table behind it: it gives way after its lock wait
// (2 s) and tries again, so the traffic goes on, and it lands once the
// long transaction ends.
func TestMigrationGivesWayToLongTransactions(t *testing.T) {
	t.Parallel()
	url, st := beforeVersion13(t)
	migrator, err := store.Open(ctx, store.Config{URL: url})
	if err != nil {
		t.Fatal(err)
	}
	defer migrator.Close()
	reader, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(ctx) // (first: the migration then ends, and its store closes)
	if _, err := reader.Exec(ctx, "SELECT count(*) FROM hipq_attempt"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := migrator.Migrate(ctx); done <- err }()
	testutil.Eventually(t, 10*time.Second, func() bool {
		return count(t, st, waiting+" AND query LIKE 'ALTER TABLE hipq_attempt%'") > 0
	}, "the migration to wait for the long transaction")
	// Traffic on the table goes on: at most one lock wait behind the ALTER.
	tx, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SET LOCAL statement_timeout = '8s'"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT count(*) FROM hipq_attempt"); err != nil {
		t.Fatalf("a read of hipq_attempt stayed blocked behind the migration: %v", err)
	}
	_ = tx.Rollback(ctx)
	select {
	case err := <-done:
		t.Fatalf("the migration ended while the long transaction ran: %v", err)
	default:
	}
	if err := reader.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("migrate after the long transaction: %v", err)
	}
	if n := count(t, st, "SELECT count(*) FROM pg_attribute WHERE attrelid = 'hipq_attempt'::regclass AND attname = 'queue' AND attnotnull"); n != 1 {
		t.Fatal("hipq_attempt.queue is not there, NOT NULL")
	}
}

// skipBeforeVersion13 is why the tests of a database before version 13
// skip on Citus.
const skipBeforeVersion13 = "stands for a database before version 13 by dropping hipq_attempt.queue, which on Citus is the distribution column (Citus refuses the drop; a database is laid out for Citus only at the latest version)"

// beforeVersion13 returns a database as schema version 12 left it (no
// queue on attempts, version 13 and later unrecorded) after the given statements,
// and a store on it.
func beforeVersion13(t *testing.T, then ...string) (string, *store.Store) {
	t.Helper()
	if pgtest.OnCitus() {
		t.Skip(skipBeforeVersion13)
	}
	url := pgtest.URL(t)
	st, err := store.Open(ctx, store.Config{URL: url})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	for _, q := range append([]string{"ALTER TABLE hipq_attempt DROP COLUMN queue", "DELETE FROM hipq_schema_migration WHERE version >= 13"}, then...) {
		if _, err := st.Pool().Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	return url, st
}

// The store's connections run without JIT compilation (its statements
// reach rows by key; JIT compiled the few whose estimates passed
// jit_above_cost at every call, for longer than they ran), unless the URL,
// the role or the database asks for it.
func TestNoJITUnlessAsked(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	// ask runs q on a store of url and returns its one text.
	ask := func(url, q string) string {
		t.Helper()
		st, err := store.Open(ctx, store.Config{URL: url})
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		var out string
		if err := st.Pool().QueryRow(ctx, q).Scan(&out); err != nil {
			t.Fatal(err)
		}
		return out
	}
	for _, tc := range []struct{ url, want string }{{url, "off"}, {url + " jit=on", "on"}, {url + " options='-c jit=on'", "on"}} {
		if got := ask(tc.url, "SHOW jit"); got != tc.want {
			t.Errorf("%q: jit %q, want %q", tc.url, got, tc.want)
		}
	}
	db := ask(url, "SELECT current_database()::text")
	alter, err := store.Open(ctx, store.Config{URL: url})
	if err != nil {
		t.Fatal(err)
	}
	_, err = alter.Pool().Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+" SET jit = on")
	alter.Close()
	if err != nil {
		t.Fatal(err)
	}
	if got := ask(url, "SHOW jit"); got != "on" {
		t.Errorf("with ALTER DATABASE ... SET jit = on: jit %q", got)
	}
}

// Invariant 7 on the reply path: the offsets' compare-and-set goes to
// PostgreSQL with the transaction's BEGIN, ahead of the replies' locks and
// writes (inTxOpen); when it fails, nothing the batch would have done is
// written, and every connection goes back to the pool fit for use (none
// left inside the failed transaction).
func TestReplyOffsetConflictWritesNothing(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("r"))
	claimSent(t, st, 1)
	batch := func(from, to int64) store.ReplyBatch {
		return store.ReplyBatch{Group: "rg", Offsets: []store.OffsetAdvance{{Topic: "replies", Partition: 0, From: from, To: to}},
			Replies: []store.ReplyIn{reply("r", 1, true)}}
	}
	if _, err := st.ReplyApply(ctx, batch(-1, 1), types); err != nil {
		t.Fatal(err)
	}
	wantState(t, get(t, st, "r"), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	insert(t, st, job("r2"))
	claimSent(t, st, 1)
	r2 := batch(0, 2) // read again by a consumer that lost the partition: the stored offset is 1
	r2.Replies = []store.ReplyIn{reply("r2", 1, true)}
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second) // (a connection leaked would block, not fail)
	defer cancel()
	for range 20 { // (more tries than the pool has connections)
		if _, err := st.ReplyApply(dctx, r2, types); !errors.Is(err, store.ErrOffsetConflict) {
			t.Fatalf("got %v, want ErrOffsetConflict", err)
		}
	}
	if n := st.Pool().Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections still acquired after the refused batches", n)
	}
	if n := count(t, st, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'`); n != 0 {
		t.Fatalf("%d sessions left inside a transaction", n)
	}
	wantState(t, get(t, st, "r2"), correlator.StateRunning, "", 1)
	if n := count(t, st, "SELECT count(*) FROM hipq_attempt WHERE outcome IS NOT NULL"); n != 1 {
		t.Fatalf("%d attempts ended, want 1 (the refused batch wrote)", n)
	}
	r2.Offsets[0].From = 1
	if _, err := st.ReplyApply(ctx, r2, types); err != nil {
		t.Fatal(err)
	}
	wantState(t, get(t, st, "r2"), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
}

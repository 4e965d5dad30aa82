package store_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/citustest"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// TestMigrateLaysOutCitus: on a real Citus cluster (a coordinator and two
// workers), migrate with database.citus at its default (auto) distributes
// the per-queue tables by queue, co-located with hipq_job, makes
// hipq_queue and hipq_schedule reference tables and leaves every other
// table local; a second migrate changes nothing.
func TestMigrateLaysOutCitus(t *testing.T) {
	st, err := store.Open(ctx, store.Config{URL: citustest.URL(t), MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for range 2 {
		if _, err := st.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	want := map[string]string{ // table: distribution column, "reference", or "local" (the coordinator's, in the metadata)
		"hipq_job": "queue", "hipq_attempt": "queue", "hipq_rate_unit": "queue", "hipq_rate_count": "queue",
		"hipq_rate_giveback": "queue", "hipq_activity": "queue", "hipq_event": "queue", "hipq_claim_lock": "queue",
		"hipq_early_reply": "queue",
		"hipq_queue":       "reference", "hipq_schedule": "reference",
	}
	local := []string{"hipq_offset", "hipq_intake", "hipq_dead_letter",
		"hipq_ui_session", "hipq_operation", "hipq_lock", "hipq_event_cursor", "hipq_schema_migration", "hipq_schema_repeatable"}
	for _, t := range local {
		want[t] = "local"
	}
	rows, err := st.Pool().Query(ctx, `
		SELECT c.relname, p.partmethod::text || p.repmodel::text, coalesce(column_to_column_name(p.logicalrelid, p.partkey), ''),
		       p.colocationid = (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = 'hipq_job'::regclass)
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		LEFT JOIN pg_dist_partition p ON p.logicalrelid = c.oid
		WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname LIKE 'hipq\_%'`)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for rows.Next() {
		var table string
		var method *string
		var column string
		var colocated *bool
		if err := rows.Scan(&table, &method, &column, &colocated); err != nil {
			t.Fatal(err)
		}
		seen[table] = true
		w, ok := want[table]
		switch {
		case !ok:
			t.Errorf("%s: not in the layout", table)
		case method == nil:
			t.Errorf("%s: not in Citus's metadata, want %s", table, w)
		case w == "reference" && *method != "nt":
			t.Errorf("%s: partmethod and repmodel %s, want a reference table (nt)", table, *method)
		case w == "local" && *method != "ns":
			t.Errorf("%s: partmethod and repmodel %s, want a local table of the coordinator's in the metadata (ns)", table, *method)
		case w == "reference" || w == "local":
		case *method != "hs" || column != w:
			t.Errorf("%s: partmethod and repmodel %s by %q, want hash by %s", table, *method, column, w)
		case !*colocated:
			t.Errorf("%s: not co-located with hipq_job", table)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for table := range want {
		if !seen[table] {
			t.Errorf("%s: no such table", table)
		}
	}
	// Citus's own view agrees.
	if n := count(t, st, "SELECT count(*) FROM citus_tables WHERE table_name::text LIKE 'hipq\\_%'"); n != len(want) {
		t.Errorf("citus_tables lists %d hipq tables, want %d", n, len(want))
	}
	// The unique keys include the distribution column.
	for index, cols := range map[string]string{
		"hipq_job_pkey": "queue, id", "hipq_job_active_key": "queue, job_type, job_key",
		"hipq_attempt_pkey": "queue, job_id, attempt", "hipq_rate_unit_pkey": "queue, id", "hipq_event_pkey": "queue, id",
		"hipq_early_reply_pkey": "queue, id",
		"hipq_rate_count_pkey":  "queue, rate, part",
	} {
		var got string
		if err := st.Pool().QueryRow(ctx, `SELECT string_agg(a.attname, ', ' ORDER BY k.i)
			FROM pg_index x, unnest(x.indkey) WITH ORDINALITY k(attnum, i), pg_attribute a
			WHERE x.indexrelid = $1::regclass AND a.attrelid = x.indrelid AND a.attnum = k.attnum`, index).Scan(&got); err != nil {
			t.Fatalf("%s: %v", index, err)
		}
		if got != cols {
			t.Errorf("%s: (%s), want (%s)", index, got, cols)
		}
	}
}

// TestMigrateCitusOnNeedsTheExtension: database.citus on, on a PostgreSQL
// without the citus extension, is refused before anything is migrated.
func TestMigrateCitusOnNeedsTheExtension(t *testing.T) {
	pgtest.SkipOnCitus(t, "every test database has the citus extension")
	st, err := store.Open(ctx, store.Config{URL: pgtest.URL(t), MaxConns: 2, Citus: store.CitusOn})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Migrate(ctx); !errors.Is(err, store.ErrNoCitus) {
		t.Fatalf("migrate with citus on and no extension: %v, want ErrNoCitus", err)
	}
}

// TestOpenRefusesAnUnknownCitusMode names the field and the choices.
func TestOpenRefusesAnUnknownCitusMode(t *testing.T) {
	_, err := store.Open(ctx, store.Config{URL: "postgres://nowhere", Citus: "yes"})
	if err == nil || err.Error() != `database.citus: "yes" is not one of [auto on off]` {
		t.Fatalf("got %v", err)
	}
}

// TestMigrateDistributeMovesASingleNodeSchema: a schema laid out on one
// PostgreSQL, with waiting, running and final jobs, is moved onto the
// cluster's layout by hipq migrate --distribute (MigrateDistribute) while
// no hipq runs, and then every job ends as it would have: a plain migrate
// refuses to move rows, and --distribute refuses while another hipq is
// connected. Its early replies move too, each to its queue's shard, and
// still match their jobs once these are sent: one kept with its queue, one
// kept before replies had one (its queue is its type's in the config);
// one of a type the config does not name is dead-lettered, not lost.
func TestMigrateDistributeMovesASingleNodeSchema(t *testing.T) {
	url := citustest.URL(t)
	single, err := store.Open(ctx, store.Config{URL: url, MaxConns: 4, Citus: store.CitusOff})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := single.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	insert(t, single, job("running"), job("done"))
	claimSent(t, single, 2)
	// (Events not relayed yet: the final one kept on its job becomes a
	// row of hipq_event, with its id, where the cluster's relay reads;
	// the table's rows move too, without the trigger that would notify
	// from the workers.)
	applyReplies(t, single.WithEvents(store.EventsOf(eventTypes())), reply("done", 1, true))
	var onJob int
	if err := single.Pool().QueryRow(ctx, `SELECT event_id FROM hipq_job WHERE job_key = 'done'`).Scan(&onJob); err != nil || count(t, single, "SELECT count(*) FROM hipq_event") != 0 {
		t.Fatalf("done's final event is not on its job on one PostgreSQL: %v", err)
	}
	insert(t, single, job("waiting"), job("later", at(-time.Hour)))
	if err := single.QueueSetPaused(ctx, "other", true); err != nil { // (a reference table's row)
		t.Fatal(err)
	}
	// Early replies: two of jobs that do not exist yet, one as a hipq
	// before schema version 24 kept it (no queue), and one of a type no
	// longer configured, kept so too.
	applyReplies(t, single, reply("early", 0, true), reply("early-old", 0, true))
	if _, err := single.Pool().Exec(ctx, `UPDATE hipq_early_reply SET queue = NULL WHERE job_key = 'early-old'`); err != nil {
		t.Fatal(err)
	}
	if _, err := single.Pool().Exec(ctx, `INSERT INTO hipq_early_reply (job_type, job_key, success, retryable, reply, topic, record_value, expires_at)
		VALUES ('gone', 'g', true, true, '{}', 'replies', 'reply g', now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	// Rate windows: a queue's, with 2 of its 3 requests taken, and a job
	// type's whose type moved from queue x to queue y (on one PostgreSQL
	// its window follows it: one count of 2).
	rated := func(q, jt string) func(*correlator.Job) {
		return func(j *correlator.Job) { j.Queue, j.JobType = q, jt }
	}
	insert(t, single, job("r1", rated("rated", "t")), job("r2", rated("rated", "t")), job("r3", rated("rated", "t")),
		job("m1", rated("x", "m")), job("m2", rated("y", "m")))
	queueRate := correlator.Throttle{Rates: []correlator.Rate{rate(t, "q:rated#0", 3, time.Hour, "", "")}}
	typeRate := correlator.Throttle{Rates: []correlator.Rate{rate(t, "t:m#0", 5, time.Hour, "m", "")}}
	for _, c := range []store.JobClaimParams{{Queue: "rated", Throttle: queueRate, Limit: 2}, {Queue: "x", Throttle: typeRate, Limit: 10},
		{Queue: "y", Throttle: typeRate, Limit: 10}} {
		c.Instance = "test"
		if got, err := single.JobClaim(ctx, c); err != nil || len(got.Jobs) == 0 {
			t.Fatalf("claim of %s: %d jobs (%v)", c.Queue, len(got.Jobs), err)
		}
	}
	if n := count(t, single, "SELECT n FROM hipq_rate_count WHERE queue = 'x' AND rate = 't:m#0'"); n != 2 {
		t.Fatalf("the moved type's window counts %d on one PostgreSQL, want 2", n)
	}
	// A rate unit from before units had a queue whose queue nothing
	// tells (its job is gone), and its window: no key of the cluster
	// takes it, nor would a claim there find it.
	if _, err := single.Pool().Exec(ctx, `INSERT INTO hipq_rate_unit (rate, part, job_ids, attempts, n, at, queue)
		VALUES ('t:old#0', '', '{0}', '{1}', 1, now(), NULL);
		INSERT INTO hipq_rate_count (rate, part, n) VALUES ('t:old#0', '', 1)`); err != nil {
		t.Fatal(err)
	}
	single.Close()

	st, err := store.Open(ctx, store.Config{URL: url, MaxConns: 4}) // (database.citus: auto)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if st.Distributed() {
		t.Fatal("a store on a schema laid out on one PostgreSQL takes the distributed statements")
	}
	// The store's own pool holds several connections: none counts as
	// another hipq.
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { _, _ = st.Pool().Exec(ctx, "SELECT pg_sleep(0.1)") })
	}
	wg.Wait()
	if _, err := st.Migrate(ctx); err == nil || !strings.Contains(err.Error(), "hipq migrate --distribute") {
		t.Fatalf("a plain migrate of a schema with rows: %v, want a refusal naming --distribute", err)
	}
	other, err := store.Open(ctx, store.Config{URL: url, MaxConns: 1})
	if err != nil {
		t.Fatal(err)
	}
	var otherPID int
	if err := other.Pool().QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&otherPID); err != nil {
		t.Fatal(err)
	}
	if _, err := st.MigrateDistribute(ctx, typeInfo); !errors.Is(err, store.ErrHipqRunning) {
		t.Fatalf("--distribute beside another hipq: %v, want ErrHipqRunning", err)
	}
	other.Close()
	// (Its server process leaves after the pool closed, not before Close
	// returns.)
	testutil.Eventually(t, 30*time.Second, func() bool {
		return count(t, st, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", otherPID) == 0
	}, "the other hipq's session (pid %d) ends", otherPID)
	if _, err := st.MigrateDistribute(ctx, typeInfo); err != nil {
		t.Fatal(err)
	}
	if !st.Distributed() {
		t.Fatal("the store does not know its database is a Citus cluster")
	}
	var shards int
	if err := st.Pool().QueryRow(ctx, `SELECT count(DISTINCT nodeport) FROM pg_dist_shard_placement p JOIN pg_dist_shard s USING (shardid)
		WHERE s.logicalrelid = 'hipq_job'::regclass`).Scan(&shards); err != nil || shards != citustest.Workers() {
		t.Fatalf("hipq_job's shards are on %d workers (%v), want %d", shards, err, citustest.Workers())
	}
	for q, want := range map[string]int{"SELECT count(*) FROM hipq_job": 9, "SELECT count(*) FROM hipq_attempt": 6,
		"SELECT count(*) FROM hipq_event": 1, "SELECT count(*) FROM hipq_queue WHERE paused": 1,
		fmt.Sprintf("SELECT count(*) FROM hipq_event WHERE job_key = 'done' AND id = %d AND outcome = 'succeeded'", onJob): 1,
		"SELECT count(*) FROM hipq_job WHERE event_id IS NOT NULL OR event_topic IS NOT NULL":                              0,
		"SELECT count(*) FROM hipq_rate_unit":                                                                       3,
		"SELECT count(*) FROM hipq_early_reply WHERE queue = 'default'":                                             2,
		"SELECT count(*) FROM hipq_dead_letter WHERE reason LIKE 'unknown_job_type:%' AND record_value = 'reply g'": 1} {
		if n := count(t, st, q); n != want {
			t.Fatalf("%s: %d on the cluster, want %d as on one PostgreSQL", q, n, want)
		}
	}
	// The rate windows are laid out by queue, each its units' sum: the
	// moved type's in both its queues.
	var windows string
	if err := st.Pool().QueryRow(ctx, `SELECT string_agg(format('%s %s %s', queue, rate, n), ', ' ORDER BY queue, rate)
		FROM hipq_rate_count`).Scan(&windows); err != nil || windows != "rated q:rated#0 2, x t:m#0 1, y t:m#0 1" {
		t.Fatalf("rate windows on the cluster: %q (%v), want each queue's with its units' sum", windows, err)
	}
	// Rates go on where they were: queue rated has 1 request left.
	if c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "rated", Throttle: queueRate, Limit: 10, Instance: "test"}); err != nil || len(c.Jobs) != 1 {
		t.Fatalf("claim of rated on the cluster: %d jobs (%v), want the 1 its window has room for", len(c.Jobs), err)
	}
	// Every job ends as it would have.
	applyReplies(t, st, reply("running", 1, true))
	c := claimSent(t, st, 10)
	if len(c) != 1 || c[0].JobKey != "waiting" {
		t.Fatalf("claimed %v, want the waiting job alone", c)
	}
	applyReplies(t, st, reply("waiting", 1, true))
	for _, k := range []string{"running", "waiting", "done"} {
		wantState(t, get(t, st, k), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	}
	wantState(t, get(t, st, "later"), correlator.StateInitial, "", 0)
	// The non-final key holds on the cluster's key: a final job's key takes
	// a new job, a waiting one's does not.
	if n, err := st.JobsInsert(ctx, []*correlator.Job{job("done"), job("later")}); err != nil || n != 1 {
		t.Fatalf("inserted %d (%v), want the new job of the final key alone", n, err)
	}
	// The early replies' jobs come and are sent: both replies apply, from
	// their queue's shard.
	insert(t, st, job("early"), job("early-old"))
	c = claimSent(t, st, 10)
	var refs []store.AttemptRef
	for _, j := range c {
		if j.JobKey == "early" || j.JobKey == "early-old" {
			refs = append(refs, j.Ref())
		}
	}
	if len(refs) != 2 {
		t.Fatalf("claimed %v, want the early replies' jobs among them", c)
	}
	applyEarlyReplies(t, st, refs, "early", "early-old")
}

// On Citus the claim lock of a queue with limits holds across nodes: a
// claim through a worker waits while a claim's transaction on the
// coordinator holds the queue's lock (an advisory lock alone is the
// node's: it would not wait), and claims once that one ends.
func TestClaimLockHoldsAcrossNodes(t *testing.T) {
	coordinator := pgtest.URL(t)
	worker := pgtest.WorkerURL(t, coordinator)
	onWorker, err := store.Open(ctx, store.Config{URL: worker, MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer onWorker.Close()
	st, err := store.Open(ctx, store.Config{URL: coordinator, MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	insert(t, st, job("a"), job("b"), job("c"))
	// A first claim makes the queue's lock row: the one held below exists.
	if c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 1, Instance: "c",
		Throttle: correlator.Throttle{Limit: 3}}); err != nil || len(c.Jobs) != 1 {
		t.Fatalf("first claim: %d jobs, %v", len(c.Jobs), err)
	}

	// A claim of the queue on the coordinator, its lock held: the claim's
	// own first statements, in a transaction left open.
	holder, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx) // (ended below)
	if err := store.TakeClaimLockForTest(ctx, holder, "default"); err != nil {
		t.Fatal(err)
	}
	got := make(chan store.Claim, 1)
	go func() {
		c, err := onWorker.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 10, Instance: "w",
			Throttle: correlator.Throttle{Limit: 2}})
		if err != nil {
			t.Error(err)
		}
		got <- c
	}()
	// The worker's claim waits for a lock the coordinator's transaction
	// holds, as Citus's cluster-wide view of lock waits shows.
	testutil.Eventually(t, 30*time.Second, func() bool {
		return count(t, st, `SELECT count(*) FROM citus_lock_waits`) > 0
	}, "the worker's claim to wait for the coordinator's lock")
	select {
	case c := <-got:
		t.Fatalf("the worker's claim took %d jobs while the coordinator's claim held the queue's lock", len(c.Jobs))
	default:
	}
	if err := holder.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if c := <-got; len(c.Jobs) != 1 {
		t.Fatalf("the worker's claim took %d jobs, want 1 (the throttle's limit of 2, one running)", len(c.Jobs))
	}
}

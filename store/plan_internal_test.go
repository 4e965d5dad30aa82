package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/hipq/hipq/internal/localcitus"
	"github.com/hipq/hipq/internal/localpg"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/hipq/hipq/correlator"
)

// Sent marks look each attempt up by its key whatever the statistics
// say: beside 200k final attempts whose statistics say no sent_at is
// NULL, a batch of 1,000 marks probes the primary key (no sequential scan
// of hipq_attempt), as a custom plan and as the generic one; the former
// statement, the control, scanned the table and joined quadratically.
func TestSentMarksProbeByKey(t *testing.T) {
	t.Parallel()
	_, st := planStore(t)
	ctx := context.Background()
	if _, err := st.pool.Exec(ctx, `
		WITH j AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, state, outcome, attempt)
		  SELECT 'q', 'old', 'k' || i, 'final', 'succeeded', 1 FROM generate_series(1, 200000) i RETURNING id)
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at, sent_at, outcome)
		SELECT 'q', id, 1, 'i', now(), now(), 'succeeded' FROM j;
		ANALYZE hipq_job; ANALYZE hipq_attempt;
		WITH j AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at)
		  SELECT 'q', 'new', 'n' || i, 'running', 1, now() - interval '1 hour' FROM generate_series(1, 1000) i RETURNING id, started_at)
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at) SELECT 'q', id, 1, 'i', started_at FROM j;`); err != nil {
		t.Fatal(err)
	}
	var refs []AttemptRef
	rows, _ := st.pool.Query(ctx, `SELECT id FROM hipq_job WHERE job_type = 'new'`)
	var id int64
	if _, err := pgx.ForEachRow(rows, []any{&id}, func() error { refs = append(refs, AttemptRef{Queue: "q", JobID: id, Attempt: 1}); return nil }); err != nil {
		t.Fatal(err)
	}
	ids, atts := refArrays(refs)
	plan := func(q string, generic bool, args ...any) string {
		return explainAnalyze(t, st, q, generic, append([]any{ids, atts}, args...)...)
	}
	old := `UPDATE hipq_attempt a SET sent_at = now() FROM unnest($1::bigint[], $2::int[]) AS u(id, att)
		WHERE a.job_id = u.id AND a.attempt = u.att AND a.sent_at IS NULL`
	if p := plan(old, false); !strings.Contains(p, "Seq Scan on hipq_attempt") {
		t.Errorf("the control no longer scans the table:\n%s", p)
	}
	for _, generic := range []bool{false, true} {
		p := explainAnalyze(t, st, markSentSQL, generic, "q", ids, atts, []*time.Time(nil))
		if strings.Contains(p, "Seq Scan") || !strings.Contains(p, "hipq_attempt_pkey") || !strings.Contains(p, "rows=1000 loops=1") {
			t.Errorf("generic plan %v:\n%s\nwant primary-key probes marking 1000 rows", generic, p)
		}
	}
	// The unsent claims are found through the running jobs, each attempt
	// by its key, on the same table.
	tx, err := st.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p := planText(t)(tx.Query(ctx, "EXPLAIN ANALYZE "+findUnsentSQL, pgx.StrictNamedArgs{"job_type": []string{"new"},
		"send_bound": []float64{1}, "grace": "1 second", "limit": 100, "queue": "q", "least_bound": 1.0,
		"since": pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}}))
	_ = tx.Rollback(ctx)
	if strings.Contains(p, "Seq Scan on hipq_attempt") || !strings.Contains(p, "hipq_attempt_pkey") {
		t.Errorf("unsent claims:\n%s\nwant primary-key probes of the running jobs' attempts", p)
	}
	if err := st.AttemptMarkSent(ctx, refs[:10]); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := st.pool.QueryRow(ctx, `SELECT count(*) FROM hipq_attempt WHERE sent_at IS NOT NULL AND instance = 'i' AND outcome IS NULL`).Scan(&n); err != nil || n != 10 {
		t.Fatalf("%d marked, %v", n, err)
	}
}

// Replies find and resolve their jobs by key whatever the statistics say:
// beside 200k final jobs analyzed when none ran, with 5,000 running, the
// reply lookup probes each (type, key) and the resolve reaches each job by
// its key and tuple id, as custom and as generic plans: no walk of every
// running or non-final job per batch (the controls, statements that join
// the batch to the table, read all 5,000 for each batch).
func TestRepliesProbeByKey(t *testing.T) {
	t.Parallel()
	_, st := planStore(t)
	ctx := context.Background()
	if _, err := st.pool.Exec(ctx, `
		INSERT INTO hipq_job (queue, job_type, job_key, state, outcome, attempt)
		SELECT 'q', 'old', 'k' || i, 'final', 'succeeded', 1 FROM generate_series(1, 200000) i;
		ANALYZE hipq_job; ANALYZE hipq_attempt;
		WITH j AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at)
		  SELECT 'q', 'new', 'n' || i, 'running', 1, now() FROM generate_series(1, 5000) i RETURNING id)
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at) SELECT 'q', id, 1, 'i', now() FROM j;`); err != nil {
		t.Fatal(err)
	}
	var ids []int64
	var types, keys []string
	rows, _ := st.pool.Query(ctx, `SELECT id, job_key FROM hipq_job WHERE job_type = 'new' ORDER BY id LIMIT 1000`)
	var id int64
	var key string
	if _, err := pgx.ForEachRow(rows, []any{&id, &key}, func() error {
		ids = append(ids, id)
		if len(types) < 500 {
			types, keys = append(types, "new"), append(keys, key)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	n := len(ids)
	atts, states, errs, attOutcomes := make([]int32, n), make([]string, n), make([]string, n), make([]string, n)
	outcomes, results, attErrs, replies := make([]*string, n), make([]*string, n), make([]*string, n), make([]*string, n)
	next, sent := make([]*time.Time, n), make([]bool, n)
	ok := "succeeded"
	for i := range ids {
		atts[i], states[i], errs[i], attOutcomes[i], outcomes[i] = 1, "final", "NONE", "succeeded", &ok
	}
	resolveArgs := pgx.StrictNamedArgs{"id": ids, "attempt": atts, "state": states, "outcome": outcomes, "error": errs, "next_run": next,
		"result": results, "att_outcome": attOutcomes, "att_error": attErrs, "reply": replies, "sent": sent,
		"result_is_reply": make([]bool, n), "claim": []*time.Time(nil), "queue": "q"}
	plan := func(q string, generic bool, args ...any) string { return explainAnalyze(t, st, q, generic, args...) }
	oldLookup := `SELECT id FROM hipq_job WHERE id IN (SELECT unnest($1::bigint[]) UNION ALL
		SELECT j.id FROM hipq_job j JOIN unnest($2::text[], $3::text[]) AS k(t, k)
		  ON j.job_type = k.t AND j.job_key = k.k AND j.state <> 'final') ORDER BY id FOR UPDATE`
	if p := plan(oldLookup, false, ids, types, keys); !strings.Contains(p, "rows=5000") {
		t.Errorf("the control lookup no longer walks the non-final jobs:\n%s", p)
	}
	oldResolve := `UPDATE hipq_job j SET update_time = now() FROM unnest($1::bigint[], $2::int[]) AS u(id, att)
		WHERE j.id = u.id AND j.state = 'running' AND j.attempt = u.att`
	if p := plan(oldResolve, false, ids, atts); !strings.Contains(p, "rows=5000") {
		t.Errorf("the control resolve no longer walks the running jobs:\n%s", p)
	}
	for _, generic := range []bool{false, true} {
		p := plan(lockTargetsSQL, generic, ids, types, keys, "q")
		if strings.Contains(p, "rows=5000") || strings.Contains(p, "Seq Scan") || !strings.Contains(p, "loops=500") ||
			!strings.Contains(p, "rows=1500 loops=1") {
			t.Errorf("reply lookup, generic plan %v:\n%s\nwant a probe per key and per id, 1500 rows locked", generic, p)
		}
		p = plan(resolveManySQL, generic, resolveArgs)
		if strings.Contains(p, "rows=5000") || strings.Contains(p, "Seq Scan") || !strings.Contains(p, "Tid Scan") ||
			!strings.Contains(p, "hipq_job_pkey") {
			t.Errorf("resolve, generic plan %v:\n%s\nwant a probe per job and an update by tuple id", generic, p)
		}
	}
	// What the new statements do, they do right: 1000 resolved, each once.
	tx, err := st.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var refs []AttemptRef
	for _, id := range ids {
		refs = append(refs, AttemptRef{Queue: "q", JobID: id, Attempt: 1})
	}
	if err := lockJobs(ctx, tx, refs); err != nil {
		t.Fatal(err)
	}
	done, err := jobResolveMany(ctx, tx, nil, func() []Resolve {
		var rs []Resolve
		for _, id := range ids {
			rs = append(rs, Resolve{Queue: "q", JobID: id, Attempt: 1, Res: correlator.Resolution{State: correlator.StateFinal,
				Outcome: correlator.OutcomeSucceeded, Error: correlator.ErrorNone, Attempt: correlator.AttemptSucceeded}})
		}
		rs = append(rs, Resolve{Queue: "q", JobID: ids[0], Attempt: 2, Res: rs[0].Res}) // a stale attempt: no effect
		return rs
	}())
	if err != nil || len(done) != n {
		t.Fatalf("%d of %d resolved: %v", len(done), n, err)
	}
}

// explainAnalyze runs q under EXPLAIN ANALYZE in a transaction it rolls
// back, as PostgreSQL's generic plan when generic, and returns the plan.
func explainAnalyze(t *testing.T, st *Store, q string, generic bool, args ...any) string {
	t.Helper()
	ctx := context.Background()
	tx, err := st.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if generic {
		if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = force_generic_plan"); err != nil {
			t.Fatal(err)
		}
	}
	return planText(t)(tx.Query(ctx, "EXPLAIN ANALYZE "+q, args...))
}

// The claim reads the first due jobs of the queue's order from that
// order's due index, in order, and moves what it picked by tuple id
// (unbounded) or key (throttled), as PostgreSQL's generic plans too
// (PL/pgSQL caches them), whatever the statistics say: never a scan of
// the table, never a sort of the due jobs (which costs the whole due
// range at every claim), never JIT. Statistics are taken at moments that
// mislead: when nothing was due (100k jobs a day ahead); through a burst
// by StatsRefresh with job_type left without statistics (on which a
// planner free to choose sorts every due job found through the unique
// index of non-final jobs, and a throttled claim, whose filters it
// underestimates, sorts the due range with them); final jobs of other
// types. The plans are read from auto_explain (nested
// statements) on the claiming connection. (A sort of the picked rows for
// the aggregates, over the subquery s, is no sort of the due jobs j.)
func TestClaimFastPathPlans(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, seed string
		refresh    bool // statistics by StatsRefresh (of the columns it analyzes) rather than ANALYZE
	}{
		{"statistics of jobs a day ahead", `
			INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time)
			SELECT 'q', 't', 'later' || i, now() + interval '1 day' FROM generate_series(1, 100000) i;
			ANALYZE hipq_job;`, false},
		{"statistics of StatsRefresh through a burst", `
			INSERT INTO hipq_job (queue, job_type, job_key)
			SELECT 'q', 't', 'first' || i FROM generate_series(1, 3000) i;`, true},
		{"statistics of final jobs of other types", `
			INSERT INTO hipq_job (queue, job_type, job_key, state, outcome, attempt)
			SELECT 'q', 'other' || i % 50, 'ended' || i, 'final', 'succeeded', 1 FROM generate_series(1, 20000) i;
			ANALYZE hipq_job;`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pg, st := planStore(t)
			ctx := context.Background()
			if _, err := st.pool.Exec(ctx, "ALTER TABLE hipq_job SET (autovacuum_enabled = off);"+tc.seed); err != nil {
				t.Fatal(err)
			}
			if tc.refresh {
				if tables, err := st.StatsRefresh(ctx); err != nil || !slices.Contains(tables, "hipq_job") {
					t.Fatalf("analyzed %v: %v", tables, err)
				}
			}
			// The burst of due jobs, in ten steps; with refresh, StatsRefresh
			// looks after each, as the instance does four times a second.
			for step := range 10 {
				if _, err := st.pool.Exec(ctx, `INSERT INTO hipq_job (queue, job_type, job_key, priority)
					SELECT 'q', 't', 'due' || $1::int || '-' || i, i % 7 FROM generate_series(1, 3000) i`, step); err != nil {
					t.Fatal(err)
				}
				if tc.refresh {
					if _, err := st.StatsRefresh(ctx); err != nil {
						t.Fatal(err)
					}
				}
			}
			conn, notices := explainedConn(t, pg.URL("postgres"), st.schema, true)
			for _, c := range []struct {
				order correlator.Order
				index string
				plans string
				limit int // a throttle: read, planned in Go, then written
			}{
				{correlator.OrderScheduledFirst, "hipq_job_due_type_sched", "force_generic_plan", 0},
				{correlator.OrderPriorityFirst, "hipq_job_due_type_prio", "force_generic_plan", 0},
				{correlator.OrderScheduledFirst, "hipq_job_due_type_sched", "force_custom_plan", 0},
				{correlator.OrderPriorityFirst, "hipq_job_due_type_prio", "force_custom_plan", 0},
				{correlator.OrderScheduledFirst, "hipq_job_due_type_sched", "force_custom_plan", 1 << 20},
				{correlator.OrderPriorityFirst, "hipq_job_due_type_prio", "force_custom_plan", 1 << 20},
				{correlator.OrderScheduledFirst, "hipq_job_due_type_sched", "force_generic_plan", 1 << 20},
			} {
				name := fmt.Sprintf("%s (%s, throttle_limit %d)", c.order, c.plans, c.limit)
				if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+c.plans); err != nil {
					t.Fatal(err)
				}
				p := JobClaimParams{Queue: "q", Order: c.order, Limit: 500, Instance: "i", Types: []string{"t"},
					Throttle: correlator.Throttle{Limit: c.limit}}
				var pick, move string
				for range 3 { // past the first calls, into the cached plans
					notices()
					n := explainClaim(t, conn, p)
					if n != 500 {
						t.Fatalf("%s: claimed %d", name, n)
					}
					pick, move = "", ""
					for _, m := range notices() {
						if strings.Contains(m, "JIT:") {
							// (a disabled plan costs more than jit_above_cost)
							t.Errorf("%s: a statement of the claim was compiled by JIT:\n%s", name, m)
						}
						switch {
						case strings.Contains(m, "/* claim */"):
							pick, move = m, m
						case strings.Contains(m, "/* claim read */"):
							pick = m
						case strings.Contains(m, "/* claim write */"):
							move = m
						}
					}
				}
				if !strings.Contains(pick, "Index Scan using "+c.index) || strings.Contains(pick, "Seq Scan") ||
					strings.Contains(pick, "Sort Key: j.") || strings.Contains(pick, "Bitmap") {
					t.Errorf("%s: the read does not read %s in order:\n%s", name, c.index, pick)
				}
				if !strings.Contains(move, "Index Scan using hipq_job_pkey") || strings.Contains(move, "Seq Scan on hipq_job") {
					t.Errorf("%s: the move is not by key:\n%s", name, move)
				}
			}
		})
	}
}

// explainClaim runs the statements of p's claim as JobClaim does, on
// conn (auto_explain's), and returns how many jobs it moved.
func explainClaim(t *testing.T, conn *pgx.Conn, p JobClaimParams) int {
	t.Helper()
	ctx := context.Background()
	var moved []Claimed
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(claimSettings)
	if !p.Throttle.Bounded() {
		args := pgx.NamedArgs{"queue": p.Queue, "limit": p.Limit, "instance": p.Instance, "windowed": []string{}, "type_0": p.Types[0]}
		b.Queue(unboundedSQL(p.Order, 1, false), args).Exec(func(ct pgconn.CommandTag) error {
			moved = make([]Claimed, ct.RowsAffected())
			return nil
		})
		b.Queue("COMMIT")
		if err := conn.SendBatch(ctx, b).Close(); err != nil {
			t.Fatal(err)
		}
		return len(moved)
	}
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		t.Fatal(err)
	}
	narrow := correlator.NarrowClaim(p.Throttle, correlator.ClaimUsage{})
	cands, err := claimRead(ctx, conn, p, &narrow, p.Limit, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := correlator.ClaimInput{Throttle: p.Throttle, Batch: p.Limit, Now: time.Now()}
	for _, c := range cands {
		in.Candidates = append(in.Candidates, c.ClaimCandidate)
	}
	plan, err := correlator.PlanClaim(in)
	if err != nil {
		t.Fatal(err)
	}
	b = &pgx.Batch{}
	claimWrite(b, p, &plan, cands, &moved)
	b.Queue("COMMIT")
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		t.Fatal(err)
	}
	return len(moved)
}

// Retention reads the oldest rows due in every queue, then deletes each
// queue's by id: a queue with few rows due never walks the others'.
func TestPruneProbesByID(t *testing.T) {
	t.Parallel()
	_, st := planStore(t)
	ctx := context.Background()
	if _, err := st.pool.Exec(ctx, `
		WITH j AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, state, outcome, attempt, update_time)
		  SELECT CASE WHEN i % 100 = 0 THEN 'small' ELSE 'big' END, 't', 'k' || i, 'final', 'succeeded', 1,
		         now() - interval '2 days' + i * interval '1 ms'
		  FROM generate_series(1, 200000) i RETURNING id, queue)
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance) SELECT queue, id, 1, 'i' FROM j;
		ANALYZE hipq_job; ANALYZE hipq_attempt;`); err != nil {
		t.Fatal(err)
	}
	rows, _ := st.pool.Query(ctx, `SELECT id FROM hipq_job WHERE queue = 'small' ORDER BY update_time LIMIT 1000`)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(ids) != 1000 {
		t.Fatalf("%d ids: %v", len(ids), err)
	}
	for _, generic := range []bool{false, true} {
		p := explainAnalyze(t, st, pruneSQL, generic, time.Hour, ids, "small")
		if strings.Contains(p, "Seq Scan") || !strings.Contains(p, "Tid Scan on hipq_job") || !strings.Contains(p, "rows=1000 loops=1") {
			t.Errorf("prune, generic plan %v:\n%s\nwant 1000 probes by id and deletes by tuple id", generic, p)
		}
	}
	if n, err := st.JobPrune(ctx, time.Hour, 5000); err != nil || n != 5000 {
		t.Fatalf("pruned %d: %v", n, err)
	}
	var n int
	if err := st.pool.QueryRow(ctx, "SELECT count(*) FROM hipq_attempt a WHERE NOT EXISTS (SELECT 1 FROM hipq_job j WHERE j.id = a.job_id)").Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d attempts of pruned jobs left: %v", n, err)
	}
}

// A statement planned while the tables were nearly empty keeps that plan
// until their statistics change. hipq's hot statements stay linear in
// their batch whatever the plan (TestHotPathsStayLinearOnNewTables), but
// such a plan may still read the whole table where a probe by key or
// tuple id would do: StatsRefresh analyzes a table once it has doubled,
// and the statements are planned again. Here the sent marks: planned on
// ten attempts, they scan hipq_attempt once 20,000 are there, until
// StatsRefresh; then they go by tuple id.
func TestStatsFollowGrowth(t *testing.T) {
	t.Parallel()
	st, conn, notices, seed := seededPlanStore(t, false, `{"pad": "`+strings.Repeat("x", 200)+`"}`)
	ctx := context.Background()
	if tables, err := st.StatsRefresh(ctx); err != nil || len(tables) != 0 {
		t.Fatalf("empty tables analyzed: %v %v", tables, err)
	}
	// mark marks refs sent through the sent marks' statement and returns
	// its plan.
	mark := func(refs []AttemptRef) string {
		t.Helper()
		ids, atts := refArrays(refs)
		notices()
		if tag, err := conn.Exec(ctx, markSentSQL, "q", ids, atts, claimsOf(refs, refClaim)); err != nil || tag.RowsAffected() != int64(len(refs)) {
			t.Fatalf("marked %d of %d: %v", tag.RowsAffected(), len(refs), err)
		}
		for _, m := range notices() {
			if strings.Contains(m, "UPDATE hipq_attempt a SET sent_at") {
				return m
			}
		}
		t.Fatal("no plan of the sent marks")
		return ""
	}
	small := seed(10)
	// A table never analyzed is analyzed as soon as it has rows, once.
	if tables, err := st.StatsRefresh(ctx); err != nil || !slices.Equal(tables, []string{"hipq_attempt", "hipq_job"}) {
		t.Fatalf("first rows: analyzed %v: %v", tables, err)
	}
	if tables, err := st.StatsRefresh(ctx); err != nil || len(tables) != 0 {
		t.Fatalf("analyzed again without growth: %v %v", tables, err)
	}
	for i := range 3 {
		mark(small[i*2 : i*2+2]) // planned and cached while the tables are nearly empty
	}
	big := seed(20000)
	if p := mark(big[:500]); !strings.Contains(p, "Seq Scan on hipq_attempt a") {
		t.Errorf("the control: the sent marks planned on an empty table no longer scan it:\n%s", p)
	}
	tables, err := st.StatsRefresh(ctx)
	if err != nil || !slices.Contains(tables, "hipq_attempt") {
		t.Fatalf("analyzed %v: %v", tables, err)
	}
	if p := mark(big[500:1000]); strings.Contains(p, "Seq Scan on hipq_") || !strings.Contains(p, "Tid Scan on hipq_attempt a") {
		t.Errorf("after StatsRefresh the sent marks still scan hipq_attempt:\n%s", p)
	}
	if tables, err := st.StatsRefresh(ctx); err != nil || len(tables) != 0 {
		t.Fatalf("analyzed again without growth: %v %v", tables, err)
	}
}

// explainedConn is a connection on which auto_explain logs every plan,
// nested statements included (with analyze: their actual rows), as generic
// plans, into the notices the returned function takes (and clears).
func explainedConn(t *testing.T, url, schema string, analyze bool) (*pgx.Conn, func() []string) {
	t.Helper()
	ctx := context.Background()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["search_path"] = schema
	var notices []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices = append(notices, n.Message) }
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(ctx) })
	for _, set := range []string{"LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
		"SET auto_explain.log_nested_statements = on", fmt.Sprintf("SET auto_explain.log_analyze = %v", analyze),
		"SET auto_explain.log_level = notice", "SET plan_cache_mode = force_generic_plan"} {
		if _, err := conn.Exec(ctx, set); err != nil {
			t.Skipf("auto_explain is not available here (%v): plans cannot be read", err)
		}
	}
	return conn, func() []string { out := notices; notices = nil; return out }
}

// A role without the tables' owner's privileges (a NOINHERIT member of the
// owner, say) does not run ANALYZE, which would skip the table with a
// warning at every check: StatsRefresh does nothing there, and says so.
func TestStatsRefreshLeavesOthersTables(t *testing.T) {
	t.Parallel()
	pg, st := planStore(t)
	ctx := context.Background()
	role := fmt.Sprintf("hipq_reader_%d", time.Now().UnixNano())
	for _, q := range []string{
		"CREATE ROLE " + role + " LOGIN NOINHERIT IN ROLE current_user",
		"GRANT USAGE ON SCHEMA public TO " + role,
		"GRANT SELECT ON ALL TABLES IN SCHEMA public TO " + role,
		`INSERT INTO hipq_job (queue, job_type, job_key, job_data)
		 SELECT 'q', 't', 'k' || i, jsonb_build_object('pad', repeat('x', 200)) FROM generate_series(1, 5000) i`,
		"ALTER TABLE hipq_job SET (autovacuum_enabled = off)",
	} {
		if _, err := st.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = st.pool.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = st.pool.Exec(context.Background(), "DROP ROLE "+role)
	})
	pc, err := pgxpool.ParseConfig(strings.Replace(pg.URL("postgres"), "user=hipq", "user="+role, 1))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var notices []string
	pc.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { mu.Lock(); notices = append(notices, n.Message); mu.Unlock() }
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	other := &Store{pool: pool, schema: st.schema, writes: st.writes}
	tables, err := other.StatsRefresh(ctx)
	mu.Lock()
	defer mu.Unlock()
	if err != nil || len(tables) != 0 || len(notices) != 0 {
		t.Fatalf("as a NOINHERIT member: analyzed %v (%v), notices %q", tables, err, notices)
	}
	if tables, err = st.StatsRefresh(ctx); err != nil || !slices.Contains(tables, "hipq_job") {
		t.Fatalf("the owner analyzed %v (%v)", tables, err)
	}
}

// Plans made while the tables were empty, as at the start of a burst into
// a new deployment, are kept (cached generic plans) while the tables grow
// until StatsRefresh's next analyze. Such a plan may be wrong for the
// bigger table, but never quadratic: a statement over a batch does each
// probe once per row of the batch and reads the table at most once
// (a sent mark's plan that scanned hipq_attempt and probed the whole batch
// for each of its rows would keep the jobs behind it waiting on the locks
// it holds).
func TestPlansOfEmptyTablesStayLinear(t *testing.T) {
	t.Parallel()
	_, conn, notices, seed := seededPlanStore(t, true, `null`)
	ctx := context.Background()
	// loops returns the largest loops= of plan's nodes.
	loops := func(plan string) int {
		most := 0
		for _, m := range regexp.MustCompile(`loops=(\d+)`).FindAllStringSubmatch(plan, -1) {
			n, _ := strconv.Atoi(m[1])
			most = max(most, n)
		}
		return most
	}
	type statement struct {
		name, marker string
		run          func(tx pgx.Tx, refs []AttemptRef) error
	}
	for _, s := range []statement{
		{"sent marks", "UPDATE hipq_attempt a SET sent_at", func(tx pgx.Tx, refs []AttemptRef) error {
			ids, atts := refArrays(refs)
			_, err := tx.Exec(ctx, markSentSQL, "q", ids, atts, claimsOf(refs, refClaim))
			return err
		}},
		{"reply lookup", "CROSS JOIN LATERAL (SELECT j.id FROM hipq_job j", func(tx pgx.Tx, refs []AttemptRef) error {
			types, keys := make([]string, len(refs)), make([]string, len(refs))
			for i, r := range refs {
				if err := tx.QueryRow(ctx, "SELECT job_type, job_key FROM hipq_job WHERE id = $1", r.JobID).Scan(&types[i], &keys[i]); err != nil {
					return err
				}
			}
			notices()
			rows, err := tx.Query(ctx, lockTargetsSQL, []int64{}, types, keys, "q")
			if err != nil {
				return err
			}
			rows.Close()
			return rows.Err()
		}},
	} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
				t.Fatal(err)
			}
			small := seed(10)
			for range 3 { // planned (and cached) while the tables are nearly empty, never analyzed
				if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return s.run(tx, small[:5]) }); err != nil {
					t.Fatalf("%s: %v", s.name, err)
				}
			}
			big := seed(400)
			notices()
			if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return s.run(tx, big[:300]) }); err != nil {
				t.Fatalf("%s: %v", s.name, err)
			}
			var plan string
			for _, m := range notices() {
				if strings.Contains(m, s.marker) {
					plan = m
				}
			}
			if plan == "" {
				t.Fatalf("%s: no plan", s.name)
			}
			if n := loops(plan); n > 300 {
				t.Errorf("%s (%s): a node of the plan ran %d times for a batch of 300:\n%s", s.name, mode, n, plan)
			}
		}
	}
}

// The hot paths (jobs inserted, claimed, marked sent, replied to by key,
// delivered with sync replies) on tables created empty, as in a new
// deployment's first burst: planned for the nearly empty tables, never
// analyzed, then analyzed by StatsRefresh (as the instance does four times
// a second), then run over 300 jobs beside a few thousand: no plan node
// runs more times than the batch has jobs (a statement is linear in its
// batch; a plan may still read a table once, comparing each row with the
// batch: TestStatsFollowGrowth). Statements are explained through a pool
// set up like the store's (auto_explain), custom and generic plans. Without StatsRefresh's first
// analyze of a table that has rows, the resolve's update of attempts ran
// a node 3,336 times.
func TestHotPathsStayLinearOnNewTables(t *testing.T) {
	t.Parallel()
	for _, generic := range []bool{false, true} {
		t.Run(map[bool]string{false: "custom plans", true: "generic plans"}[generic], func(t *testing.T) {
			t.Parallel()
			st, plain, plans := explainStore(t, generic, true)
			ctx := context.Background()
			autovacuumOff(t, plain)
			round := 0
			life := func(n int) {
				t.Helper()
				round++
				hotPaths(t, st, fmt.Sprintf("r%d-", round), n)
			}
			for range 3 {
				life(6) // planned while the tables are nearly empty
			}
			if _, err := plain.StatsRefresh(ctx); err != nil { // as the instance does, four times a second
				t.Fatal(err)
			}
			for range 3 {
				life(6)
			}
			if _, err := plain.pool.Exec(ctx, `
				WITH j AS (
				  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at)
				  SELECT 'q', 't', 'ran' || i, 'running', 1, now() FROM generate_series(1, 3000) i RETURNING id)
				INSERT INTO hipq_attempt (queue, job_id, attempt, instance) SELECT 'q', id, 1, 'i' FROM j`); err != nil {
				t.Fatal(err)
			}
			plans()
			const batch = 300
			life(batch)
			seen := 0
			for _, e := range plans() {
				seen++
				most := 0.0
				e.Plan.walk(func(n planNode) {
					if l, ok := n["Actual Loops"].(float64); ok {
						most = max(most, l)
					}
				})
				if most > batch {
					js, _ := json.MarshalIndent(e.Plan, "", " ")
					t.Errorf("a plan node ran %.0f times for a batch of %d:\n%s\n%s", most, batch, strings.TrimSpace(e.Query), js)
				}
			}
			if seen < 8 {
				t.Fatalf("only %d statements explained", seen)
			}
		})
	}
}

// hotPaths runs n new jobs of queue q through the hot paths: inserted,
// claimed, half marked sent then replied to by key, half delivered with a
// sync reply by id. Their keys start with prefix.
func hotPaths(t *testing.T, st *Store, prefix string, n int) {
	t.Helper()
	ctx := context.Background()
	types := correlator.Types{"t": &correlator.JobType{Name: "t", Queue: "q", Timeout: time.Hour, Priority: 100, ThrottleFactor: 1,
		Delivery: correlator.AtLeastOnce}}
	var jobs []*correlator.Job
	for i := range n {
		jobs = append(jobs, &correlator.Job{Queue: "q", JobType: "t", JobKey: fmt.Sprintf("%s%d", prefix, i), JobData: json.RawMessage(`{"i":1}`),
			MaxAttempts: 1, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600})
	}
	if got, err := st.JobsInsert(ctx, jobs); err != nil || got != n {
		t.Fatalf("inserted %d of %d: %v", got, n, err)
	}
	c, err := st.JobClaim(ctx, JobClaimParams{Queue: "q", Limit: n, Instance: "i"})
	if err != nil || len(c.Jobs) != n {
		t.Fatalf("claimed %d of %d: %v", len(c.Jobs), n, err)
	}
	half := c.Jobs[:n/2]
	var refs []AttemptRef
	var replies []ReplyIn
	for _, j := range half {
		refs = append(refs, j.Ref())
		replies = append(replies, ReplyIn{Reply: &correlator.Reply{JobType: "t", JobKey: j.JobKey, Success: true}, Kind: SourceReply, Source: Source{Topic: "r"}})
	}
	if err := st.AttemptMarkSent(ctx, refs); err != nil {
		t.Fatal(err)
	}
	rr, err := st.ReplyApply(ctx, ReplyBatch{Group: "g", EarlyTTL: time.Hour, Replies: replies}, types)
	if err != nil || len(rr.Applied) != len(half) {
		t.Fatalf("replies applied %d of %d: %v", len(rr.Applied), len(half), err)
	}
	var d Delivery
	for _, j := range c.Jobs[n/2:] {
		id, att := j.ID, j.Attempt
		d.Sent = append(d.Sent, j.Ref())
		d.Replies = append(d.Replies, ReplyIn{Reply: &correlator.Reply{JobID: &id, Attempt: &att, Success: true}, Kind: SourceCallback})
	}
	res, err := st.DeliveryRecord(ctx, d, types)
	if err != nil || len(res.Replies.Applied) != n-n/2 {
		t.Fatalf("delivered %d of %d: %v", len(res.Replies.Applied), n-n/2, err)
	}
}

// --db-profile names the family of every statement of the hot paths: none
// is left in "other" (pg_stat_statements normalizes constants, so the
// families match the statements' texts as it stores them).
func TestStatementFamilies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, err := localpg.Start(ctx, localpg.Options{Settings: map[string]string{"shared_preload_libraries": "pg_stat_statements"}})
	if err != nil {
		t.Skip(err)
	}
	t.Cleanup(pg.Stop)
	st, err := Open(ctx, Config{URL: pg.URL("postgres")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	if _, err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := st.StatementsReset(ctx); err != nil {
		t.Fatal(err)
	}
	hotPaths(t, st, "k", 100)
	families, err := st.StatementsRead(ctx)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int64{}
	for _, f := range families {
		seen[f.Family] = f.Rows
	}
	for _, want := range []string{"claim (reads, plan writes, rate settling)", "resolve (replies, timeouts)", "job inserts (intake, API, outbox)",
		"sent marks", "job locks (deliveries, resolves)", "reply lookup"} {
		if seen[want] == 0 {
			t.Errorf("no rows in family %q: %v", want, families)
		}
	}
	if seen["other"] >= 50 {
		t.Errorf("%d rows of hot statements in \"other\": %v", seen["other"], families)
	}
}

// On Citus, --db-profile names the family of the hot statements each node
// runs: the coordinator's as on one PostgreSQL, and the worker's, which
// are the statements Citus sends to the shards (named by shard, rewritten
// from the coordinator's, without their comments) and the intermediate
// results and two-phase commits around them.
func TestStatementFamiliesOnCitus(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, st := citusPlanStore(t, localcitus.Options{Settings: map[string]string{"shared_preload_libraries": "pg_stat_statements"}})
	worker, err := Open(ctx, Config{URL: c.WorkerURLs("d")[0], Citus: CitusOff})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(worker.Close)
	for _, s := range []*Store{st, worker} { // the coordinator first: it creates the extension on the worker
		if err := s.StatementsReset(ctx); err != nil {
			t.Fatal(err)
		}
	}
	hotPaths(t, st, "k", 100)
	for _, node := range []struct {
		name string
		st   *Store
	}{{"coordinator", st}, {"worker", worker}} {
		families, err := node.st.StatementsRead(ctx)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]int64{}
		for _, f := range families {
			seen[f.Family] = f.Rows
		}
		for _, want := range []string{"claim (reads, plan writes, rate settling)", "resolve (replies, timeouts)", "job inserts (intake, API, outbox)",
			"sent marks", "job locks (deliveries, resolves)", "reply lookup"} {
			if seen[want] == 0 {
				t.Errorf("%s: no rows in family %q: %v", node.name, want, families)
			}
		}
		if seen["other"] >= 50 {
			t.Errorf("%s: %d rows of hot statements in \"other\": %v", node.name, seen["other"], families)
		}
	}
}

// citusPlanStore is a store of its own, migrated, on database d of a
// throwaway Citus cluster (a coordinator and a worker); the test skips
// where Citus is not installed.
func citusPlanStore(t *testing.T, opts localcitus.Options) (*localcitus.Cluster, *Store) {
	t.Helper()
	ctx := context.Background()
	c, err := localcitus.Start(ctx, 1, opts)
	if errors.Is(err, localcitus.ErrNoCitus) {
		t.Skip(err.Error() + ": this test needs Citus")
	} else if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Stop)
	u, err := c.NewDatabase(ctx, "d", "")
	if err != nil {
		t.Fatal(err)
	}
	st, err := Open(ctx, Config{URL: u, Citus: CitusOn})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	if _, err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return c, st
}

// seededPlanStore is a store of its own with autovacuum off (its analyze
// would do what the plan tests test), a connection that explains the
// statements it runs (analyze: with their actual rows and loops), and a
// seeder of running jobs (job_data data).
func seededPlanStore(t *testing.T, analyze bool, data string) (*Store, *pgx.Conn, func() []string, func(n int) []AttemptRef) {
	t.Helper()
	pg, st := planStore(t)
	conn, notices := explainedConn(t, pg.URL("postgres"), st.schema, analyze)
	autovacuumOff(t, st)
	return st, conn, notices, runningSeeder(t, st, data)
}

// runningSeeder returns a function that inserts n running jobs of queue q
// (job_data data), each with its attempt 1, and returns their attempts.
func runningSeeder(t *testing.T, st *Store, data string) func(n int) []AttemptRef {
	seeded := 0
	return func(n int) []AttemptRef {
		t.Helper()
		seeded++
		rows, _ := st.pool.Query(context.Background(), `
			WITH j AS (
			  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at, job_data)
			  SELECT 'q', 't', 'k' || i || '-' || $2::int, 'running', 1, now(), $3::jsonb
			  FROM generate_series(1, $1::int) i RETURNING id)
			INSERT INTO hipq_attempt (queue, job_id, attempt, instance) SELECT 'q', id, 1, 'i' FROM j RETURNING job_id`, n, seeded, data)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil || len(ids) != n {
			t.Fatalf("seeded %d: %v", len(ids), err)
		}
		refs := make([]AttemptRef, n)
		for i, id := range ids {
			refs[i] = AttemptRef{Queue: "q", JobID: id, Attempt: 1}
		}
		return refs
	}
}

// The sweeper's search for unsent claims reads each queue's running jobs
// claimed longer ago than the least send bound, by index, whatever the
// statistics: beside a burst of 50,000 jobs claimed just now and 100,000
// final ones, on statistics taken when the table was empty, it reads and
// probes the 50 old claims only, 40 of them each of its own timeout: no
// scan of the table, no probe of a new claim's attempt, and at most 250
// pages of hipq_job (the new claims' index entries are not walked).
func TestUnsentFinderReadsOldClaimsOnly(t *testing.T) {
	t.Parallel()
	st, plain, plans := sweepPlanStore(t, false)
	ctx := context.Background()
	if _, err := plain.pool.Exec(ctx, `
		WITH j AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at)
		  SELECT 'q', 't', CASE WHEN i <= 10 THEN 'old' ELSE 'new' END || i, 'running', 1,
		         CASE WHEN i <= 10 THEN now() - interval '1 hour' ELSE now() - i * interval '0.5 milliseconds' END
		  FROM generate_series(1, 50010) i RETURNING id, started_at)
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at) SELECT 'q', id, 1, 'i', started_at FROM j;
		-- 40 more old claims, each of its own timeout: 9 of them past the 32
		-- timeouts read one by one.
		WITH j AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at, timeout_seconds)
		  SELECT 'q', 't', 'odd' || i, 'running', 1, now() - interval '1 hour', 100000 + i FROM generate_series(1, 40) i
		  RETURNING id, started_at)
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at) SELECT 'q', id, 1, 'i', started_at FROM j`); err != nil {
		t.Fatal(err)
	}
	types := correlator.Types{"t": &correlator.JobType{Name: "t", Queue: "q", Timeout: time.Hour}}
	plans()
	unsent, _, err := st.AttemptFindUnsent(ctx, types, time.Second, 100, nil)
	if err != nil || len(unsent) != 50 {
		t.Fatalf("found %d unsent claims, want the 50 old ones: %v", len(unsent), err)
	}
	seen := 0
	for _, e := range plans() {
		e.Plan.walk(func(n planNode) {
			if strings.Contains(n.str("Node Type"), "Seq Scan") {
				t.Errorf("a scan of %s:\n%s", n.str("Relation Name"), e.Query)
			}
			if n.str("Relation Name") == "hipq_attempt" {
				seen++
				if l, _ := n["Actual Loops"].(float64); l > 50 {
					t.Errorf("%v probes of attempts for 50 old claims:\n%s", l, e.Query)
				}
			}
			// (Index entries a scan passes over are no rows: its pages are
			// what a walk of the new claims would show.)
			hit, _ := n["Shared Hit Blocks"].(float64)
			read, _ := n["Shared Read Blocks"].(float64)
			if n.str("Relation Name") == "hipq_job" && hit+read > 250 {
				t.Errorf("%v pages of hipq_job read for 50 old claims:\n%s", hit+read, e.Query)
			}
		})
	}
	if seen == 0 {
		t.Fatal("no plan read hipq_attempt")
	}
}

// A search for unsent claims that starts from the marks of the one before
// reads the claims that became old enough since (less LateClaimMargin),
// not every old running job again: beside 50,000 claims sent an hour ago
// (running jobs awaiting late replies: the first search reads them all),
// it reads a few pages. A claim not yet past its own type's bound caps
// its queue's mark, so it is found once it is; a claim that became
// visible late is found within the margin, and past it by a search from
// no marks (which the sweeper runs now and then).
func TestUnsentSearchStartsFromItsMarks(t *testing.T) {
	t.Parallel()
	st, plain, plans := sweepPlanStore(t, false)
	ctx := context.Background()
	exec := func(q string) {
		t.Helper()
		if _, err := plain.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	// (a running job's started_at is its attempt's dispatched_at)
	running := func(key string, n int, ago, sent string, typ string) {
		exec(fmt.Sprintf(`WITH j AS (
			  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at)
			  SELECT 'q', '%[5]s', '%[1]s' || i, 'running', 1, now() - interval '%[3]s' FROM generate_series(1, %[2]d) i
			  RETURNING id, started_at)
			INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at, sent_at)
			SELECT 'q', id, 1, 'i', started_at, %[4]s FROM j`, key, n, ago, sent, typ))
	}
	running("sent", 50000, "1 hour", "started_at", "t")
	running("lost", 1, "1 hour", "NULL", "t")
	running("slow", 1, "5 minutes", "NULL", "slow") // within its bound: not yet lost
	exec("ANALYZE hipq_job; ANALYZE hipq_attempt")
	types := correlator.Types{"t": &correlator.JobType{Name: "t", SendTimeout: 30 * time.Second},
		"slow": &correlator.JobType{Name: "slow", SendTimeout: time.Hour}}
	keys := func(us []Unsent) []string {
		var out []string
		for _, u := range us {
			var k string
			if err := plain.pool.QueryRow(ctx, "SELECT job_key FROM hipq_job WHERE id = $1", u.JobID).Scan(&k); err != nil {
				t.Fatal(err)
			}
			out = append(out, k)
		}
		slices.Sort(out)
		return out
	}
	pages := func() float64 {
		var n float64
		for _, e := range plans() {
			e.Plan.walk(func(p planNode) {
				if p.str("Relation Name") == "hipq_job" {
					hit, _ := p["Shared Hit Blocks"].(float64)
					read, _ := p["Shared Read Blocks"].(float64)
					n += hit + read
				}
			})
		}
		return n
	}
	plans()
	unsent, marks, err := st.AttemptFindUnsent(ctx, types, time.Second, 100, nil)
	if err != nil || !slices.Equal(keys(unsent), []string{"lost1"}) {
		t.Fatalf("first search: %v %v", keys(unsent), err)
	}
	if p := pages(); p < 300 {
		t.Fatalf("the first search read %v pages of hipq_job: the test no longer shows a full read", p)
	}
	var slowAt time.Time
	if err := plain.pool.QueryRow(ctx, "SELECT started_at FROM hipq_job WHERE job_key = 'slow1'").Scan(&slowAt); err != nil {
		t.Fatal(err)
	}
	if !marks["q"].Equal(slowAt) {
		t.Fatalf("mark %v, want the start of the claim not yet past its bound, %v", marks["q"], slowAt)
	}
	exec("UPDATE hipq_attempt SET sent_at = now() WHERE job_id = (SELECT id FROM hipq_job WHERE job_key = 'lost1')") // (rescued)
	// Late claims: one started within the margin before the mark, one before it.
	exec(fmt.Sprintf(`WITH j AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at)
		  VALUES ('q', 't', 'late', 'running', 1, '%[1]s'::timestamptz - interval '30 seconds'),
		         ('q', 't', 'later', 'running', 1, '%[1]s'::timestamptz - interval '90 seconds')
		  RETURNING id, started_at)
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at) SELECT 'q', id, 1, 'i', started_at FROM j`,
		marks["q"].Format(time.RFC3339Nano)))
	plans()
	unsent, marks2, err := st.AttemptFindUnsent(ctx, types, time.Second, 100, marks)
	if err != nil || !slices.Equal(keys(unsent), []string{"late"}) {
		t.Fatalf("search from the marks: %v %v, want the claim within the margin", keys(unsent), err)
	}
	if p := pages(); p > 30 {
		t.Errorf("a search from the marks read %v pages of hipq_job", p)
	}
	if !marks2["q"].Equal(slowAt) {
		t.Fatalf("mark %v, want it still at the claim not yet past its bound", marks2["q"])
	}
	// Once past its bound (a grace that makes every claim lost), the
	// capped claim is found from the marks.
	if unsent, _, err := st.AttemptFindUnsent(ctx, types, -2*time.Hour, 100, marks2); err != nil || !slices.Contains(keys(unsent), "slow1") {
		t.Fatalf("the claim that capped the mark: %v %v", keys(unsent), err)
	}
	// A search from no marks finds them all.
	if unsent, _, err := st.AttemptFindUnsent(ctx, types, time.Second, 100, nil); err != nil || !slices.Equal(keys(unsent), []string{"late", "later"}) {
		t.Fatalf("a search from no marks: %v %v", keys(unsent), err)
	}
	// A search that lists its limit keeps the marks it started from.
	if _, m, err := st.AttemptFindUnsent(ctx, types, time.Second, 1, marks2); err != nil || !maps.Equal(m, marks2) {
		t.Fatalf("marks after a full batch: %v, want %v: %v", m, marks2, err)
	}
}

// The intake's claim of the jobs it stores probes each queue's due jobs by
// the due index, whatever the statistics: beside 100,000 final jobs and
// 100,000 due jobs of another queue, on statistics taken when no job
// waited, an intake batch that claims reads a few pages of hipq_job,
// with no sequential scan and no join that reads the due jobs (an
// anti-join could read every due job of every queue per batch).
func TestIntakeClaimProbesTheDueIndex(t *testing.T) {
	t.Parallel()
	for _, generic := range []bool{false, true} {
		t.Run(map[bool]string{false: "custom plans", true: "generic plans"}[generic], func(t *testing.T) {
			t.Parallel()
			st, plain, plans := sweepPlanStore(t, generic)
			ctx := context.Background()
			if _, err := plain.pool.Exec(ctx, `
				ANALYZE hipq_job; -- (statistics that say no job waits)
				INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time)
				SELECT 'x', 't', 'due' || i, now() - interval '1 minute' FROM generate_series(1, 100000) i;
				-- a backlog a day ahead in the queue stored to, of all priorities
				INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time, priority)
				SELECT 'y', 't', 'tomorrow' || i, now() + interval '1 day', i % 7 FROM generate_series(1, 100000) i`); err != nil {
				t.Fatal(err)
			}
			for round := range 7 { // (past the five custom plans a generic one follows)
				b := IntakeBatch{Group: "g", Instance: "i", Limits: map[string]IntakeLimits{"y": {}},
					Offsets: []OffsetAdvance{{Topic: "in", Partition: 0, From: int64(round*10) - 1, To: int64(round*10 + 9)}}}
				for i := range 10 {
					b.Jobs = append(b.Jobs, IntakeJob{Claim: true, Source: Source{Topic: "in"}, Job: &correlator.Job{Queue: "y", JobType: "t",
						JobKey: fmt.Sprintf("new%d-%d", round, i), JobData: []byte(`{}`), MaxAttempts: 1, Priority: 100, ThrottleFactor: 1,
						TimeoutSeconds: 3600}})
				}
				plans()
				res, err := st.IntakeApply(ctx, b)
				if err != nil || len(res.Claimed) != 10 {
					t.Fatalf("round %d: claimed %d of 10: %v", round, len(res.Claimed), err)
				}
				for _, e := range plans() {
					if !strings.Contains(e.Query, "INSERT INTO hipq_job") {
						continue
					}
					pages := 0.0
					e.Plan.walk(func(n planNode) {
						if n.str("Relation Name") != "hipq_job" || n.str("Node Type") == "ModifyTable" { // (the insert itself)
							return
						}
						if strings.Contains(n.str("Node Type"), "Seq Scan") {
							t.Errorf("round %d: a scan of hipq_job", round)
						}
						hit, _ := n["Shared Hit Blocks"].(float64)
						read, _ := n["Shared Read Blocks"].(float64)
						pages += hit + read
					})
					if pages > 40 {
						js, _ := json.MarshalIndent(e.Plan, "", " ")
						t.Errorf("round %d: %v pages of hipq_job read to store 10 jobs:\n%s", round, pages, js)
					}
				}
			}
		})
	}
}

// The sweeper's timeouts read the running jobs whose time is up, not every
// running job: beside 5,000 jobs running within their timeout and 100,000
// final ones, on statistics taken when the table was empty, each queue's
// running jobs are read by timeout_seconds then started_at. Of 300 jobs of
// a short timeout past their time, a sweep of 4 reads 4 (the range of each
// timeout is cut at the sweep's size); 2 jobs given a later deadline by news
// and 2 whose requests never left (the rescue's: invariant 8) are not timed
// out; past the 32 smallest timeouts, read one by one, the jobs of the
// others (200 here, none reached one probe per value) are read together, and
// the 2 of them past their time are timed out. A sweep reads neither
// every running job of the queue (nor, ordered by id, every row of the
// table) nor, once a job has timed out, every attempt in search of
// deadlines that news moved.
func TestTimeoutsReadExpiredJobsOnly(t *testing.T) {
	t.Parallel()
	for _, generic := range []bool{false, true} {
		t.Run(map[bool]string{false: "custom plans", true: "generic plans"}[generic], func(t *testing.T) {
			t.Parallel()
			st, plain, plans := sweepPlanStore(t, generic)
			ctx := context.Background()
			if _, err := plain.pool.Exec(ctx, `
				WITH j AS (
				  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at, timeout_seconds)
				  SELECT 'q', 't', k, 'running', 1, now() - make_interval(secs => ago), secs
				  FROM (SELECT 'now' || i AS k, 0 AS ago, 3600 AS secs FROM generate_series(1, 5000) i
				        UNION ALL SELECT 'short' || i, 3600, 60 FROM generate_series(1, 300) i
				        UNION ALL SELECT 'long' || i, 7200, 3600 FROM generate_series(1, 3) i
				        UNION ALL SELECT 'news' || i, 3600, 60 FROM generate_series(1, 2) i
				        UNION ALL SELECT 'unsent' || i, 3600, 60 FROM generate_series(1, 2) i
				        UNION ALL SELECT 'many' || i, 0, 100000 + i FROM generate_series(1, 200) i
				        UNION ALL SELECT 'rare' || i, 300000, 200000 + i FROM generate_series(1, 2) i) s
				  RETURNING id, job_key, started_at)
				INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at, sent_at, deadline)
				SELECT 'q', id, 1, 'i', started_at, CASE WHEN job_key NOT LIKE 'unsent%' THEN started_at END,
				       CASE WHEN job_key LIKE 'news%' THEN now() + interval '1 hour' END FROM j`); err != nil {
				t.Fatal(err)
			}
			types := correlator.Types{"t": &correlator.JobType{Name: "t", Queue: "q", Timeout: time.Hour, Priority: 100, ThrottleFactor: 1}}
			check := func(sweep int, bounded bool) {
				t.Helper()
				seen := 0
				for _, e := range plans() {
					e.Plan.walk(func(n planNode) {
						if strings.Contains(n.str("Node Type"), "Seq Scan") {
							t.Errorf("sweep %d: a scan of %s:\n%s", sweep, n.str("Relation Name"), e.Query)
						}
						rows, _ := n["Actual Rows"].(float64)
						loops, _ := n["Actual Loops"].(float64)
						removed, _ := n["Rows Removed by Filter"].(float64)
						if n.str("Relation Name") != "hipq_job" {
							return
						}
						seen++
						if loops > 40 && strings.Contains(e.Query, "WITH RECURSIVE") {
							t.Errorf("sweep %d: hipq_job read %v times (once per timeout?):\n%s", sweep, loops, e.Query)
						}
						if read := (rows + removed) * loops; bounded && read > 100 {
							t.Errorf("sweep %d: %v rows of hipq_job read for 4 timeouts:\n%s", sweep, read, e.Query)
						}
					})
				}
				if seen == 0 {
					t.Fatalf("sweep %d: no plan read hipq_job", sweep)
				}
			}
			plans()
			done, err := st.JobTimeOutStuck(ctx, 4, types)
			if err != nil || len(done) != 4 {
				t.Fatalf("timed out %d jobs, want 4: %v", len(done), err)
			}
			check(1, true)
			done, err = st.JobTimeOutStuck(ctx, 1000, types)
			if err != nil || len(done) != 301 {
				t.Fatalf("timed out %d jobs, want the other 301 past their time: %v", len(done), err)
			}
			check(2, false)
			var keys []string
			if err := plain.pool.QueryRow(ctx, `SELECT array_agg(job_key ORDER BY job_key) FROM hipq_job WHERE outcome = 'timed_out'`).Scan(&keys); err != nil {
				t.Fatal(err)
			}
			if len(keys) != 305 || slices.ContainsFunc(keys, func(k string) bool {
				return strings.HasPrefix(k, "news") || strings.HasPrefix(k, "now") || strings.HasPrefix(k, "many") || strings.HasPrefix(k, "unsent")
			}) {
				t.Errorf("timed out %d: %v", len(keys), keys)
			}
		})
	}
}

// sweepPlanStore is explainStore (analyzed plans, generic or custom) over
// tables holding 100,000 final jobs of queue q, on statistics taken while
// they were empty (autovacuum off): the sweeper's statements are then
// planned as on a table that grew since its last analyze.
func sweepPlanStore(t *testing.T, generic bool) (ex, plain *Store, plans func() []explained) {
	t.Helper()
	ex, plain, plans = explainStore(t, generic, true)
	autovacuumOff(t, plain)
	if _, err := plain.pool.Exec(context.Background(), `
		ANALYZE hipq_job; ANALYZE hipq_attempt;
		INSERT INTO hipq_job (queue, job_type, job_key, state, outcome, attempt)
		SELECT 'q', 't', 'f' || i, 'final', 'succeeded', 1 FROM generate_series(1, 100000) i`); err != nil {
		t.Fatal(err)
	}
	return ex, plain, plans
}

// autovacuumOff keeps autovacuum off hipq_job and hipq_attempt: its
// analyze would change the statistics a test sets up.
func autovacuumOff(t *testing.T, st *Store) {
	t.Helper()
	if _, err := st.pool.Exec(context.Background(),
		"ALTER TABLE hipq_job SET (autovacuum_enabled = off); ALTER TABLE hipq_attempt SET (autovacuum_enabled = off)"); err != nil {
		t.Fatal(err)
	}
}

// The dispatcher's probe for due jobs reads the due index by time, and
// sorts nothing, whatever the statistics say: beside some 60,000 final
// jobs, 100,000 due ones of another queue and 100,000 running ones of a
// type rare when the statistics were taken, on statistics taken while a
// burst of 50,000 jobs of the probed queue waited (most rows due, in that
// queue: a sequential scan would find one at once), a probe of that
// queue, its burst since ended and 100,000 jobs a day ahead left, reads a
// few pages; so do probes of a queue with a job due, of the queue of the
// 100,000 due jobs, and of the rare type. With custom and generic plans
// alike.
func TestDueProbeReadsTheDueIndex(t *testing.T) {
	t.Parallel()
	for _, generic := range []bool{false, true} {
		t.Run(map[bool]string{false: "custom plans", true: "generic plans"}[generic], func(t *testing.T) {
			t.Parallel()
			st, plain, plans := sweepPlanStore(t, generic)
			ctx := context.Background()
			if _, err := plain.pool.Exec(ctx, `
				INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time)
				SELECT 'y', 't', 'burst' || i, now() - interval '1 minute' FROM generate_series(1, 50000) i;
				INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time) VALUES ('y', 'u', 'rare', now() - interval '1 minute');
				DELETE FROM hipq_job WHERE queue = 'q' AND job_key > 'f2';
				ANALYZE hipq_job;
				UPDATE hipq_job SET state = 'final', outcome = 'succeeded', attempt = 1 WHERE queue = 'y';
				INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time)
				SELECT 'x', 't', 'due' || i, now() - interval '1 minute' FROM generate_series(1, 100000) i;
				INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time, priority)
				SELECT 'y', 't', 'tomorrow' || i, now() + interval '1 day', i % 7 FROM generate_series(1, 100000) i;
				INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at)
				SELECT 'r', 'u', 'running' || i, 'running', 1, now() FROM generate_series(1, 100000) i;
				INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time) VALUES ('z', 't', 'z', now() - interval '1 minute'),
				  ('y', 't', 'later', now() + interval '1 hour')`); err != nil {
				t.Fatal(err)
			}
			if _, err := plain.pool.Exec(ctx, `VACUUM hipq_job`); err != nil { // (the burst's index entries gone, its statistics kept)
				t.Fatal(err)
			}
			for round := range 7 { // (past the five custom plans a generic one follows)
				for _, c := range []struct {
					queue, typ string
					want       bool
				}{{"y", "t", false}, {"z", "t", true}, {"q", "t", false}, {"x", "t", true}, {"y", "u", false}} {
					queue, want := c.queue+"/"+c.typ, c.want
					plans()
					due, err := st.JobsDue(ctx, c.queue, []string{c.typ})
					if err != nil || due != want {
						t.Fatalf("round %d, queue %s: due %v (%v), want %v", round, queue, due, err, want)
					}
					seen := 0
					for _, e := range plans() {
						if !strings.Contains(e.Query, "due probe") {
							continue
						}
						seen++
						pages := 0.0
						e.Plan.walk(func(n planNode) {
							if strings.Contains(n.str("Node Type"), "Seq Scan") {
								t.Errorf("round %d, queue %s: a scan of %s", round, queue, n.str("Relation Name"))
							}
							if strings.Contains(n.str("Node Type"), "Sort") {
								t.Errorf("round %d, queue %s: a sort", round, queue)
							}
							if n.str("Relation Name") != "hipq_job" {
								return
							}
							if n.str("Index Name") != "hipq_job_due_type_sched" {
								t.Errorf("round %d, queue %s: hipq_job read by %s %s, not the due index by time", round, queue,
									n.str("Node Type"), n.str("Index Name"))
							}
							hit, _ := n["Shared Hit Blocks"].(float64)
							read, _ := n["Shared Read Blocks"].(float64)
							pages += hit + read
						})
						if pages > 10 {
							js, _ := json.MarshalIndent(e.Plan, "", " ")
							t.Errorf("round %d, queue %s: %v pages of hipq_job read to probe one queue:\n%s", round, queue, pages, js)
						}
					}
					if seen != 1 {
						t.Fatalf("round %d, queue %s: %d plans of the probe explained, want 1", round, queue, seen)
					}
				}
			}
		})
	}
}

// A claim's write moves only what is still as the claim read it: a job
// deferred to its next window meanwhile (same state and attempt, another
// scheduled_run_time) or past its expiry meanwhile is not moved.
func TestClaimWriteSkipsJobsMovedSinceTheRead(t *testing.T) {
	t.Parallel()
	_, st := planStore(t)
	ctx := context.Background()
	if _, err := st.pool.Exec(ctx, `INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time)
		SELECT 'q', 't', k, now() - interval '1 minute' FROM unnest(ARRAY['deferred', 'expired', 'kept']) k`); err != nil {
		t.Fatal(err)
	}
	conn, err := st.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	p := JobClaimParams{Queue: "q", Limit: 10, Instance: "i", Types: []string{"t"}, Throttle: correlator.Throttle{Limit: 100}}
	narrow := correlator.NarrowClaim(p.Throttle, correlator.ClaimUsage{})
	cands, err := claimRead(ctx, conn, p, &narrow, p.Limit, nil)
	if err != nil || len(cands) != 3 {
		t.Fatalf("read %d of 3 candidates: %v", len(cands), err)
	}
	in := correlator.ClaimInput{Throttle: p.Throttle, Batch: p.Limit, Now: time.Now()}
	for _, c := range cands {
		in.Candidates = append(in.Candidates, c.ClaimCandidate)
	}
	plan, err := correlator.PlanClaim(in)
	if err != nil || len(plan.Take) != 3 {
		t.Fatalf("plan takes %d of 3: %v", len(plan.Take), err)
	}
	if _, err := st.pool.Exec(ctx, `
		UPDATE hipq_job SET scheduled_run_time = now() + interval '1 hour' WHERE job_key = 'deferred';
		UPDATE hipq_job SET expires_at = now() - interval '1 second' WHERE job_key = 'expired'`); err != nil {
		t.Fatal(err)
	}
	var moved []Claimed
	b := &pgx.Batch{}
	claimWrite(b, p, &plan, cands, &moved)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		t.Fatal(err)
	}
	if len(moved) != 1 || moved[0].JobKey != "kept" {
		t.Fatalf("moved %+v, want the job that stayed as read alone", moved)
	}
}

package store

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
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
		INSERT INTO hipq_attempt (job_id, attempt, instance, dispatched_at, sent_at, outcome)
		SELECT id, 1, 'i', now(), now(), 'succeeded' FROM j;
		ANALYZE hipq_job; ANALYZE hipq_attempt;
		WITH j AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, state, attempt)
		  SELECT 'q', 'new', 'n' || i, 'running', 1 FROM generate_series(1, 1000) i RETURNING id)
		INSERT INTO hipq_attempt (job_id, attempt, instance, dispatched_at) SELECT id, 1, 'i', now() FROM j;`); err != nil {
		t.Fatal(err)
	}
	var refs []AttemptRef
	rows, _ := st.pool.Query(ctx, `SELECT id FROM hipq_job WHERE job_type = 'new'`)
	var id int64
	if _, err := pgx.ForEachRow(rows, []any{&id}, func() error { refs = append(refs, AttemptRef{JobID: id, Attempt: 1}); return nil }); err != nil {
		t.Fatal(err)
	}
	ids, atts := refArrays(refs)
	plan := func(q string, generic bool) string {
		tx, err := st.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck
		if generic {
			if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = force_generic_plan"); err != nil {
				t.Fatal(err)
			}
		}
		return planText(t)(tx.Query(ctx, "EXPLAIN ANALYZE "+q, ids, atts))
	}
	old := `UPDATE hipq_attempt a SET sent_at = now() FROM unnest($1::bigint[], $2::int[]) AS u(id, att)
		WHERE a.job_id = u.id AND a.attempt = u.att AND a.sent_at IS NULL`
	if p := plan(old, false); !strings.Contains(p, "Seq Scan on hipq_attempt") {
		t.Errorf("the control no longer scans the table:\n%s", p)
	}
	for _, generic := range []bool{false, true} {
		p := plan(markSentSQL, generic)
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
	p := planText(t)(tx.Query(ctx, "EXPLAIN ANALYZE "+findUnsentSQL, []string{"new"}, []float64{1}, 30.0, "1 second", 100))
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

package store

import (
	"context"
	"strings"
	"testing"

	"github.com/hipq/hipq/internal/localcitus"
)

// On Citus the reads of trace contexts and of progress deadlines go to
// the shard of their queue, and read it by its primary key: beside 20,000
// running jobs, each read of 10 is one task (Citus's EXPLAIN: "Task Count:
// 1"), with no sequential scan. By id alone (the reads before) each was a
// task on every shard of the table, the queue's read all through.
func TestTraceReadsGoToTheirQueuesShard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, st := citusPlanStore(t, localcitus.Options{})
	for _, q := range []string{
		`INSERT INTO hipq_job (queue, job_type, job_key, state, attempt, started_at, trace_parent)
		 SELECT 'q', 't', 'k' || i, 'running', 1, now(), '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'
		 FROM generate_series(1, 20000) i`,
		`INSERT INTO hipq_attempt (queue, job_id, attempt, instance, trace_parent, deadline)
		 SELECT queue, id, 1, 'i', trace_parent, now() + interval '1 hour' FROM hipq_job`,
		`ANALYZE hipq_job`, `ANALYZE hipq_attempt`,
	} {
		if _, err := st.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	var ids []int64
	var atts []int32
	rows, _ := st.pool.Query(ctx, `SELECT id FROM hipq_job WHERE queue = 'q' ORDER BY id OFFSET 5000 LIMIT 10`)
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids, atts = append(ids, id), append(atts, 1)
	}
	if err := rows.Err(); err != nil || len(ids) != 10 {
		t.Fatalf("%d ids: %v", len(ids), err)
	}
	for _, r := range []struct {
		name, sql string
		args      []any
	}{
		{"job trace contexts", jobTracesSQL, []any{"q", ids}},
		{"attempt trace contexts", attemptTracesSQL, []any{"q", ids, atts}},
		{"attempt deadlines", attemptDeadlinesSQL, []any{"q", ids, atts}},
	} {
		tx, err := st.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SET LOCAL citus.explain_all_tasks = on"); err != nil {
			t.Fatal(err)
		}
		plan := planText(t)(tx.Query(ctx, "EXPLAIN "+r.sql, r.args...))
		_ = tx.Rollback(ctx)
		if !strings.Contains(plan, "Task Count: 1\n") || strings.Contains(plan, "Seq Scan") {
			t.Errorf("%s: want one task reading its shard by index:\n%s", r.name, plan)
		}
		// (And the read finds its rows.)
		n := 0
		rows, err := st.pool.Query(ctx, r.sql, r.args...)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			n++
		}
		if err := rows.Err(); err != nil || n != 10 {
			t.Errorf("%s: %d rows of 10: %v", r.name, n, err)
		}
	}
}

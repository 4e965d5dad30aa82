package store

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// The relay's delete of a batch costs that batch, whichever index of
// hipq_event the planner takes: with only the primary key, or only
// hipq_event_topic (the other dropped in the test's transaction, so each
// plan is the one the planner would make when it prefers that index), a
// delete of 100 events beside 20,000 pending reads a few hundred blocks of
// the table and its indexes. By id alone, through hipq_event_topic, the
// delete scanned that whole index for every id of the batch (thousands of
// blocks here; 0.3-1 s a delete once a burst's relayed events were dead in
// it, the relay falling behind the jobs).
func TestEventDeletesProbeByTopicAndID(t *testing.T) {
	t.Parallel()
	_, st := planStore(t)
	ctx := context.Background()
	if _, err := st.pool.Exec(ctx, `
		INSERT INTO hipq_event (queue, topic, job_id, job_type, job_key, attempt, outcome, state)
		SELECT 'q', CASE WHEN i % 2 = 0 THEN 't' ELSE 'u' END, i, 'jt', 'k' || i, 1, 'succeeded', 'final'
		FROM generate_series(1, 20000) i`); err != nil {
		t.Fatal(err)
	}
	if _, err := st.pool.Exec(ctx, `VACUUM ANALYZE hipq_event`); err != nil {
		t.Fatal(err)
	}
	rows, _ := st.pool.Query(ctx, `SELECT id FROM hipq_event WHERE topic = 't' ORDER BY id OFFSET 5000 LIMIT 100`)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(ids) != 100 {
		t.Fatalf("%d ids: %v", len(ids), err)
	}
	const blocks = `SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid))::bigint FROM pg_class c
		WHERE c.oid = 'hipq_event'::regclass OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'hipq_event'::regclass)`
	for _, only := range []struct{ index, dropOther string }{
		{"hipq_event_pkey", "DROP INDEX hipq_event_topic"},
		{"hipq_event_topic", "ALTER TABLE hipq_event DROP CONSTRAINT hipq_event_pkey"},
	} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			func() {
				tx, err := st.pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(ctx) //nolint:errcheck // (the index comes back with the rollback)
				if _, err := tx.Exec(ctx, only.dropOther); err != nil {
					t.Fatal(err)
				}
				if _, err := tx.Exec(ctx, eventPlanSettings+", set_config('plan_cache_mode', '"+mode+"', true)"); err != nil {
					t.Fatal(err)
				}
				var before, after int64
				if err := tx.QueryRow(ctx, blocks).Scan(&before); err != nil {
					t.Fatal(err)
				}
				tag, err := tx.Exec(ctx, eventDeleteSQL, "t", ids)
				if err != nil || tag.RowsAffected() != 100 {
					t.Fatalf("deleted %d of 100: %v", tag.RowsAffected(), err)
				}
				if err := tx.QueryRow(ctx, blocks).Scan(&after); err != nil {
					t.Fatal(err)
				}
				n := after - before
				t.Logf("with %s only (%s): %d blocks", only.index, mode, n)
				if n > 1000 {
					t.Errorf("with %s only (%s): a delete of 100 events read %d blocks of hipq_event and its indexes", only.index, mode, n)
				}
			}()
		}
	}
}

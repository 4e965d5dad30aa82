package store

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/hipq/hipq/correlator"
)

// The relay's delete of a batch costs that batch, whatever the statistics
// of hipq_event say and whichever of its indexes the planner takes. The
// statistics here are those of a relay that had caught up (hipq_event
// analyzed while empty, after a burst was relayed and vacuumed) when
// 20,000 events arrive; the delete of 100 of them is planned with both
// indexes, with only the primary key and with only hipq_event_topic (the
// other dropped in the test's rolled-back transaction), as custom and as
// generic plans: it reads an index entry per event and a few hundred
// blocks. Deletes by the list of ids read far more: by id alone through
// hipq_event_topic, a scan of the whole index for every id (8,000 blocks
// here; 0.3-1 s a delete in a burst, the relay falling behind); with the
// topic named too, through hipq_event_topic by the topic alone, every
// entry of the topic (10,000), each row compared with the list.
// Each is planned with the relay's planner settings (one PostgreSQL) and
// without them (Citus runs the delete on the queue's worker, where the
// coordinator's transaction settings do not reach).
func TestEventDeletesProbeByTopicAndID(t *testing.T) {
	t.Parallel()
	_, st := planStore(t)
	ctx := context.Background()
	seed := `INSERT INTO hipq_event (queue, topic, job_id, job_type, job_key, attempt, outcome, state)
		SELECT 'q', CASE WHEN i % 2 = 0 THEN 't' ELSE 'u' END, i, 'jt', 'k' || i, 1, 'succeeded', 'final'
		FROM generate_series(1, 20000) i`
	for _, q := range []string{seed, `DELETE FROM hipq_event`, `VACUUM (TRUNCATE false) hipq_event`, `ANALYZE hipq_event`, seed} {
		if _, err := st.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	rows, _ := st.pool.Query(ctx, `SELECT id FROM hipq_event WHERE topic = 't' ORDER BY id OFFSET 5000 LIMIT 100`)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(ids) != 100 {
		t.Fatalf("%d ids: %v", len(ids), err)
	}
	// (By the transaction's statistics: the index entries the indexes
	// returned, and the blocks of the table and its indexes read.)
	const read = `SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0)::bigint,
		  (SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid))::bigint FROM pg_class c
		   WHERE c.oid = 'hipq_event'::regclass OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'hipq_event'::regclass))
		FROM pg_index i WHERE i.indrelid = 'hipq_event'::regclass`
	for _, v := range []struct{ indexes, drop string }{
		{"both indexes", ""},
		{"the primary key only", "DROP INDEX hipq_event_topic"},
		{"hipq_event_topic only", "ALTER TABLE hipq_event DROP CONSTRAINT hipq_event_pkey"},
	} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			for _, settings := range []struct{ name, sql string }{{"planner settings", eventPlanSettings + ", "}, {"no settings", "SELECT "}} {
				func() {
					tx, err := st.pool.Begin(ctx)
					if err != nil {
						t.Fatal(err)
					}
					defer tx.Rollback(ctx) // (what the test dropped comes back with the rollback)
					if v.drop != "" {
						if _, err := tx.Exec(ctx, v.drop); err != nil {
							t.Fatal(err)
						}
					}
					if _, err := tx.Exec(ctx, settings.sql+"set_config('plan_cache_mode', '"+mode+"', true)"); err != nil {
						t.Fatal(err)
					}
					var before, after, blocksBefore, blocksAfter int64
					if err := tx.QueryRow(ctx, read).Scan(&before, &blocksBefore); err != nil {
						t.Fatal(err)
					}
					tag, err := tx.Exec(ctx, eventDeleteSQL, "q", "t", ids)
					if err != nil || tag.RowsAffected() != 100 {
						t.Fatalf("%s, %s, %s: deleted %d of 100: %v", v.indexes, mode, settings.name, tag.RowsAffected(), err)
					}
					if err := tx.QueryRow(ctx, read).Scan(&after, &blocksAfter); err != nil {
						t.Fatal(err)
					}
					n, blocks := after-before, blocksAfter-blocksBefore
					t.Logf("%s (%s, %s): %d index entries, %d blocks read", v.indexes, mode, settings.name, n, blocks)
					if n > 300 || blocks > 1000 {
						t.Errorf("%s (%s, %s): a delete of 100 events read %d index entries and %d blocks", v.indexes, mode, settings.name, n, blocks)
					}
				}()
			}
		}
	}
}

// A transaction open anywhere in the cluster holds every snapshot's xmin
// back, so the relay's cursor cannot pass what it sent: it remembers the
// events read from jobs and sent, up to its maxSent, and strikes the rest
// from their jobs with the delete (event_id cleared). None is sent twice,
// none is left pending, and the memory stays bounded however long the
// transaction stays open.
func TestEventCursorStrikesWhatItCannotPass(t *testing.T) {
	t.Parallel()
	_, st := planStore(t)
	ctx := context.Background()
	end := func(n int) {
		t.Helper()
		if _, err := st.pool.Exec(ctx, `INSERT INTO hipq_job (queue, job_type, job_key, state, outcome, event_topic, event_id)
			SELECT 'q', 'jt', 'k' || i || '-' || nextval('hipq_event_id_seq'), 'final', 'succeeded', 't', currval('hipq_event_id_seq')
			FROM generate_series(1, $1) i`, n); err != nil {
			t.Fatal(err)
		}
	}
	// (its transaction id older than every event's)
	long, err := st.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = long.Rollback(ctx) }()
	if _, err := long.Exec(ctx, `SELECT pg_current_xact_id()`); err != nil {
		t.Fatal(err)
	}
	c, err := st.EventCursorOf(ctx, "t")
	if err != nil {
		t.Fatal(err)
	}
	c.maxSent = 5
	relay := func() int {
		t.Helper()
		evs, err := st.EventReadFrom(ctx, "t", c, 4)
		if err != nil {
			t.Fatal(err)
		}
		refs := make([]EventRef, len(evs))
		for i := range evs {
			refs[i] = evs[i].Ref()
		}
		if err := st.EventDeleteFrom(ctx, c, refs, 0); err != nil {
			t.Fatal(err)
		}
		return len(evs)
	}
	end(10)
	sent := 0
	for range 10 {
		sent += relay()
	}
	if sent != 10 {
		t.Fatalf("sent %d events, want each of the 10 once", sent)
	}
	if len(c.sent) > c.maxSent {
		t.Errorf("the cursor remembers %d sent events, more than its %d", len(c.sent), c.maxSent)
	}
	if c.After() != 0 {
		t.Fatalf("the cursor passed %d while a transaction older than the events was open", c.After())
	}
	var left, struck int
	if err := st.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE event_id IS NOT NULL), count(*) FILTER (WHERE event_id IS NULL) FROM hipq_job`).Scan(&left, &struck); err != nil {
		t.Fatal(err)
	}
	if left > c.maxSent || struck < 10-c.maxSent {
		t.Errorf("%d jobs keep their event id and %d were struck, want at most %d kept", left, struck, c.maxSent)
	}
	// Once the transaction ends, the cursor passes the rest, and what
	// comes after is sent as before.
	if err := long.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	end(3)
	for range 5 {
		sent += relay()
	}
	if sent != 13 {
		t.Fatalf("sent %d events in all, want 13", sent)
	}
	pending, err := st.EventsPending(ctx)
	if err != nil || len(pending) != 0 {
		t.Fatalf("pending %v (%v), want none", pending, err)
	}
}

// A role that may write the tables but not take ids from hipq_event's
// sequence itself (an insert into hipq_event needs no privilege on it) or
// not write the relay's cursors leaves no final event on its jobs: its
// events are rows, as before schema version 27. The owner leaves them.
func TestFinalEventsOnJobsNeedTheirPrivileges(t *testing.T) {
	t.Parallel()
	pg, st := planStore(t)
	ctx := context.Background()
	types := correlator.Types{"t": {Name: "t", Queue: "q", Events: correlator.Events{Topic: "ev"}}}
	if !st.WithEvents(EventsOf(types)).events.finalOnJob(ctx, st.pool) {
		t.Fatal("the tables' owner may not leave final events on jobs")
	}
	role := fmt.Sprintf("hipq_app_%d", time.Now().UnixNano())
	for _, q := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"GRANT USAGE ON SCHEMA public TO " + role,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO " + role,
	} {
		if _, err := st.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = st.pool.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = st.pool.Exec(context.Background(), "DROP ROLE "+role)
	})
	pool, err := pgxpool.New(ctx, strings.Replace(pg.URL("postgres"), "user=hipq", "user="+role, 1))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	other := (&Store{pool: pool, schema: st.schema, writes: st.writes}).WithEvents(EventsOf(types))
	if other.events.finalOnJob(ctx, pool) {
		t.Fatal("a role without USAGE on hipq_event_id_seq leaves final events on jobs")
	}
	if _, err := st.pool.Exec(ctx, "GRANT USAGE ON SEQUENCE hipq_event_id_seq TO "+role+"; REVOKE UPDATE ON hipq_event_cursor FROM "+role); err != nil {
		t.Fatal(err)
	}
	if (&Store{pool: pool, schema: st.schema, writes: st.writes}).WithEvents(EventsOf(types)).events.finalOnJob(ctx, pool) {
		t.Fatal("a role that may insert into hipq_event_cursor but not update it leaves final events on jobs")
	}
	if _, err := st.pool.Exec(ctx, "GRANT UPDATE ON hipq_event_cursor TO "+role); err != nil {
		t.Fatal(err)
	}
	if !(&Store{pool: pool, schema: st.schema, writes: st.writes}).WithEvents(EventsOf(types)).events.finalOnJob(ctx, pool) {
		t.Fatal("a role with the sequence's USAGE and the cursors' INSERT and UPDATE may not leave final events on jobs")
	}
}

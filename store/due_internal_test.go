package store

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
)

// blocksRead counts the blocks of hipq_job and of its indexes that f's
// statements read, in one transaction of its own (rolled back).
func blocksRead(t *testing.T, st *Store, f func(tx pgx.Tx) error) int64 {
	t.Helper()
	ctx := context.Background()
	tx, err := st.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	const read = `SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid))::bigint FROM pg_class c
		WHERE c.oid = 'hipq_job'::regclass OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'hipq_job'::regclass)`
	var before, after int64
	if err := tx.QueryRow(ctx, read).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if err := f(tx); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, read).Scan(&after); err != nil {
		t.Fatal(err)
	}
	return after - before
}

// stuckBacklog is a store whose queue q holds 200,000 due jobs of type
// stuck, due an hour ago, and 10 of type t, due a minute ago, vacuumed and
// analyzed.
func stuckBacklog(t *testing.T) *Store {
	t.Helper()
	_, st := planStore(t)
	ctx := context.Background()
	if _, err := st.pool.Exec(ctx, `
		INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time)
		SELECT 'q', 'stuck', 'stuck' || i, now() - interval '1 hour' FROM generate_series(1, 200000) i;
		INSERT INTO hipq_job (queue, job_type, job_key, scheduled_run_time)
		SELECT 'q', 't', 'due' || i, now() - interval '1 minute' FROM generate_series(1, 10) i;
		`); err != nil {
		t.Fatal(err)
	}
	if _, err := st.pool.Exec(ctx, "VACUUM ANALYZE hipq_job"); err != nil {
		t.Fatal(err)
	}
	return st
}

// A probe or a claim for some types costs its batch, whatever backlog
// another type of the queue holds: beside 200,000 due jobs of a type that
// cannot be sent (due before every other), the probe for another type and
// the claim of its 10 due jobs, in either order, throttled or not, read a
// few dozen blocks of hipq_job and its indexes, not the backlog.
func TestDueReadsSkipOtherTypesBacklog(t *testing.T) {
	t.Parallel()
	st := stuckBacklog(t)
	ctx := context.Background()
	const most = 300 // (a walk of the backlog reads hundreds of thousands)
	if n := blocksRead(t, st, func(tx pgx.Tx) error {
		var due bool
		return tx.QueryRow(ctx, dueProbeSQL, "q", []string{"t"}).Scan(&due)
	}); n > most {
		t.Errorf("the due probe of type t read %d blocks, want at most %d", n, most)
	}
	for _, order := range []string{"scheduled_first", "priority_first"} {
		for _, limit := range []int{0, 1 << 20} {
			name := fmt.Sprintf("%s, throttle_limit %d", order, limit)
			var claimed int
			if n := blocksRead(t, st, func(tx pgx.Tx) error {
				return tx.QueryRow(ctx, `SELECT count(*) FROM hipq_claim('q', $1, 100, 'i', '{t}', NULL, $2, NULL, NULL, NULL, NULL, NULL, NULL)`,
					order, limit).Scan(&claimed)
			}); n > most || claimed != 10 {
				t.Errorf("%s: the claim of type t took %d of 10 and read %d blocks, want at most %d", name, claimed, n, most)
			}
		}
	}
	// Two types, one stuck, the other's jobs taken in order through the merge.
	var claimed int
	if n := blocksRead(t, st, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, `SELECT count(*) FROM hipq_claim('q', 'scheduled_first', 5, 'i', '{t,u}', NULL, 0, NULL, NULL, NULL, NULL, NULL, NULL)`).Scan(&claimed)
	}); n > most || claimed != 5 {
		t.Errorf("the claim of types t and u took %d of 5 and read %d blocks, want at most %d", claimed, n, most)
	}
}

// A type whose own rate window is full is not read at all: beside its
// 200,000 due jobs, a claim of it and another type reads the other's.
func TestClaimSkipsTypesWithFullWindows(t *testing.T) {
	t.Parallel()
	st := stuckBacklog(t)
	ctx := context.Background()
	if _, err := st.pool.Exec(ctx, "INSERT INTO hipq_rate_count (rate, part, n) VALUES ('t:stuck#0', '', 5)"); err != nil {
		t.Fatal(err)
	}
	const rates = `[{"key": "t:stuck#0", "limit": 5, "secs": 3600, "type": "stuck", "path": null}]`
	var claimed int
	if n := blocksRead(t, st, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, `SELECT count(*) FROM hipq_claim('q', 'scheduled_first', 100, 'i', '{stuck,t}', NULL, 0, NULL, NULL, NULL, NULL, NULL, $1)`,
			rates).Scan(&claimed)
	}); n > 300 || claimed != 10 {
		t.Errorf("the claim took %d of 10 and read %d blocks, want at most 300", claimed, n)
	}
}

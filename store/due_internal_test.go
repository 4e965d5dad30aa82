package store

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
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
	one := oneConn(t, st)
	for _, order := range []correlator.Order{correlator.OrderScheduledFirst, correlator.OrderPriorityFirst} {
		for _, limit := range []int{0, 1 << 20} {
			name := fmt.Sprintf("%s, throttle_limit %d", order, limit)
			var c Claim
			if n := claimBlocksRead(t, one, func() (err error) {
				c, err = one.JobClaim(ctx, JobClaimParams{Queue: "q", Order: order, Limit: 100, Instance: "i", Types: []string{"t"},
					Throttle: correlator.Throttle{Limit: limit}})
				return err
			}); n > most || len(c.Jobs) != 10 {
				t.Errorf("%s: the claim of type t took %d of 10 and read %d blocks, want at most %d", name, len(c.Jobs), n, most)
			}
			undoAll(t, one, c)
		}
	}
	// Two types, one stuck, the other's jobs taken in order through the merge.
	var c Claim
	if n := claimBlocksRead(t, one, func() (err error) {
		c, err = one.JobClaim(ctx, JobClaimParams{Queue: "q", Limit: 5, Instance: "i", Types: []string{"t", "u"}})
		return err
	}); n > most || len(c.Jobs) != 5 {
		t.Errorf("the claim of types t and u took %d of 5 and read %d blocks, want at most %d", len(c.Jobs), n, most)
	}
}

// oneConn is a store on st's database with one connection: what it reads
// is its one backend's (claimBlocksRead).
func oneConn(t *testing.T, st *Store) *Store {
	t.Helper()
	one, err := Open(context.Background(), Config{URL: st.pool.Config().ConnString(), MaxConns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(one.Close)
	return one
}

// claimBlocksRead is how many blocks of hipq_job and its indexes f read
// through st, a store of one connection (oneConn): the backend's counters
// are flushed before and after.
func claimBlocksRead(t *testing.T, st *Store, f func() error) int64 {
	t.Helper()
	ctx := context.Background()
	read := func() int64 {
		// (The flush happens once the backend is idle: after this
		// statement, before the next.)
		if _, err := st.pool.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
			t.Fatal(err)
		}
		var n int64
		if err := st.pool.QueryRow(ctx, `SELECT sum(pg_stat_get_blocks_fetched(c.oid))::bigint FROM pg_class c
			WHERE c.oid = 'hipq_job'::regclass OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'hipq_job'::regclass)`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := read()
	if err := f(); err != nil {
		t.Fatal(err)
	}
	n := read() - before
	if n == 0 {
		t.Fatal("the claim read no block: the counters were not flushed")
	}
	t.Logf("%d blocks read", n)
	return n
}

// undoAll undoes c's claims, leaving the jobs due again.
func undoAll(t *testing.T, st *Store, c Claim) {
	t.Helper()
	var refs []AttemptRef
	for _, j := range c.Jobs {
		refs = append(refs, j.Ref())
	}
	if _, err := st.JobUndoClaim(context.Background(), refs); err != nil {
		t.Fatal(err)
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
	rate, err := correlator.NewRate("t:stuck#0", 5, time.Hour, "stuck", "")
	if err != nil {
		t.Fatal(err)
	}
	one := oneConn(t, st)
	var c Claim
	if n := claimBlocksRead(t, one, func() (err error) {
		c, err = one.JobClaim(ctx, JobClaimParams{Queue: "q", Limit: 100, Instance: "i", Types: []string{"stuck", "t"},
			Throttle: correlator.Throttle{Rates: []correlator.Rate{rate}}})
		return err
	}); n > 300 || len(c.Jobs) != 10 {
		t.Errorf("the claim took %d of 10 and read %d blocks, want at most 300", len(c.Jobs), n)
	}
}

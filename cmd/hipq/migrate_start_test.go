package main

import (
	"context"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/testutil"
)

// Migrations run as long as they need at start: the start timeout bounds
// the other steps only. A migration that waits (here on a lock another
// session holds; in production, an index built CONCURRENTLY over a big
// table) past the start timeout still completes, and the instance starts;
// bounded, it would be cut short at every restart.
func TestMigrationsOutlastTheStartTimeout(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	cfg := e.config(e2eConfig)
	ctx := context.Background()
	first, err := newApp(ctx, cfg, nopLogger(), appOptions{roles: []string{"sweeper"}})
	if err != nil {
		t.Fatal(err)
	}
	defer first.close()
	db := first.st.Pool()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "LOCK TABLE hipq_schema_migration IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	const timeout = time.Second
	started := make(chan error, 1)
	go func() {
		a, err := newApp(ctx, cfg, nopLogger(), appOptions{roles: []string{"sweeper"}, startTimeout: timeout})
		if err == nil {
			a.close()
		}
		started <- err
	}()
	// The second start's migration waits for the lock; hold it past the
	// start timeout, then let go.
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		var n int
		err := db.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
			WHERE c.relname = 'hipq_schema_migration' AND NOT l.granted`).Scan(&n)
		return err == nil && n > 0, "no waiter"
	}, "the migration waiting for the lock")
	waited := time.Now()
	time.Sleep(timeout + 500*time.Millisecond) // the scenario: a migration longer than the start timeout
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-started:
		if err != nil {
			t.Fatalf("start after a migration of %v (start timeout %v): %v", time.Since(waited).Round(time.Millisecond), timeout, err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the start did not end")
	}
}

package store

import (
	"context"
	"slices"
	"testing"
	"time"
)

// An instance waiting for the migration lock never deadlocks the holder's
// CREATE INDEX CONCURRENTLY, which waits for every older snapshot to end:
// the waiter polls for the lock instead of waiting in a statement (which
// would hold a snapshot: the build would wait for it, and it for the lock).
func TestMigrateWaiterLetsAnIndexBuild(t *testing.T) {
	t.Parallel()
	_, st := planStore(t)
	ctx := context.Background()
	holder, err := st.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release()
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(migrationLock)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := st.Migrate(ctx); done <- err }()
	// Give the second migration time to ask for the lock (a waiting
	// statement shows as a lock not granted; polls leave no trace).
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		var waiting bool
		if err := st.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted)`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
	}
	buildCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := holder.Exec(buildCtx, "CREATE INDEX CONCURRENTLY hipq_job_test_built ON hipq_job (created_at)"); err != nil {
		t.Fatalf("the holder's concurrent index build: %v", err)
	}
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock($1)", int64(migrationLock)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the waiting migration: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the waiting migration did not end")
	}
}

// A no-transaction migration's statements end at a line ending with a
// semicolon outside a dollar-quoted body; comment lines outside bodies are
// dropped.
func TestStatementsKeepBodiesWhole(t *testing.T) {
	m := Migration{SQL: "-- hipq: no transaction\n-- a comment\nALTER TABLE a ADD COLUMN b int;\n" +
		"CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$\nBEGIN\n    -- inside\n    RETURN 1;\nEND $$;\n" +
		"DO $$ BEGIN PERFORM 1; END $$;\nDO $$\nBEGIN\n    PERFORM f();\nEND $$;\nSELECT 1\n;\n"}
	got := m.Statements()
	want := []string{"ALTER TABLE a ADD COLUMN b int;",
		"CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$\nBEGIN\n    -- inside\n    RETURN 1;\nEND $$;",
		"DO $$ BEGIN PERFORM 1; END $$;", "DO $$\nBEGIN\n    PERFORM f();\nEND $$;", "SELECT 1\n;"}
	if !slices.Equal(got, want) {
		t.Fatalf("statements:\n%q\nwant\n%q", got, want)
	}
}

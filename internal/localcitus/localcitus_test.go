package localcitus_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/internal/localcitus"
)

// A library asked for besides Citus loads after it (Citus refuses to start
// otherwise), on every node alike, and a database is a cluster whose
// coordinator knows its worker.
func TestStartLoadsCitusFirst(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := localcitus.Start(ctx, 1, localcitus.Options{Settings: map[string]string{"shared_preload_libraries": "pg_stat_statements"}})
	if errors.Is(err, localcitus.ErrNoCitus) {
		t.Skip(err.Error() + ": this test needs Citus")
	} else if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	u, err := c.NewDatabase(ctx, "d", "")
	if err != nil {
		t.Fatal(err)
	}
	for i, url := range append([]string{u}, c.WorkerURLs("d")...) {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		var libs string
		if err := conn.QueryRow(ctx, "SHOW shared_preload_libraries").Scan(&libs); err != nil {
			t.Fatal(err)
		}
		if libs != "citus,pg_stat_statements" {
			t.Errorf("node %d: shared_preload_libraries = %q, want citus first, then pg_stat_statements", i, libs)
		}
		if i == 0 {
			var workers int
			if err := conn.QueryRow(ctx, "SELECT count(*) FROM citus_get_active_worker_nodes()").Scan(&workers); err != nil || workers != 1 {
				t.Errorf("active workers: %d %v, want 1", workers, err)
			}
		}
		conn.Close(ctx)
	}
	if _, err := localcitus.Start(ctx, 0, localcitus.Options{}); err == nil {
		t.Error("a cluster of no workers started")
	}
}

// Attach uses a running cluster, given its coordinator's URL: a database
// it makes is a cluster of every node pg_dist_node names (reached at the
// host and port the coordinator knows, with the URL's user), a frozen one
// is a template, and Stop drops what it made, on every node, and leaves
// the cluster running.
func TestAttachUsesARunningCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := localcitus.Start(ctx, 1, localcitus.Options{})
	if errors.Is(err, localcitus.ErrNoCitus) {
		t.Skip(err.Error() + ": this test needs Citus")
	} else if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	if _, err := c.NewDatabase(ctx, "meta", ""); err != nil { // (the cluster's metadata: its nodes)
		t.Fatal(err)
	}
	a, err := localcitus.Attach(ctx, c.URL("meta"))
	if err != nil {
		t.Fatal(err)
	}
	if a.Workers() != 1 {
		t.Fatalf("attached: %d workers, want 1", a.Workers())
	}
	u, err := a.NewDatabase(ctx, "made", "")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	var workers int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM citus_get_active_worker_nodes()").Scan(&workers); err != nil || workers != 1 {
		t.Fatalf("active workers of a database made: %d (%v), want 1", workers, err)
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE d (k text PRIMARY KEY); SELECT create_distributed_table('d', 'k'); INSERT INTO d VALUES ('x')"); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	if err := a.Freeze(ctx, "made"); err != nil {
		t.Fatal(err)
	}
	copied, err := a.NewDatabase(ctx, "copied", "made")
	if err != nil {
		t.Fatal(err)
	}
	if conn, err = pgx.Connect(ctx, copied); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM d").Scan(&n); err != nil || n != 1 {
		t.Fatalf("rows of the copy's distributed table: %d (%v), want 1", n, err)
	}
	conn.Close(ctx)
	a.Stop()
	for _, u := range append([]string{c.URL("postgres")}, c.WorkerURLs("postgres")...) {
		conn, err := pgx.Connect(ctx, u)
		if err != nil {
			t.Fatalf("the cluster after Stop: %v", err)
		}
		var left int
		err = conn.QueryRow(ctx, "SELECT count(*) FROM pg_database WHERE datname IN ('made', 'copied')").Scan(&left)
		conn.Close(ctx)
		if err != nil || left != 0 {
			t.Fatalf("%d databases made left on a node after Stop (%v)", left, err)
		}
	}
}

package citustest_test

import (
	"context"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/internal/citustest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	citustest.Stop()
	os.Exit(code)
}

// TestClusterHasItsWorkers: a test's database is a Citus cluster whose
// coordinator knows every worker, and a distributed table spreads its
// shards over them.
func TestClusterHasItsWorkers(t *testing.T) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, citustest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var workers int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM citus_get_active_worker_nodes()").Scan(&workers); err != nil {
		t.Fatal(err)
	}
	if workers != citustest.Workers() {
		t.Fatalf("active workers: got %d, want %d", workers, citustest.Workers())
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE d (k text PRIMARY KEY); SELECT create_distributed_table('d', 'k')"); err != nil {
		t.Fatal(err)
	}
	var nodes int
	if err := conn.QueryRow(ctx, `SELECT count(DISTINCT nodeport) FROM pg_dist_shard_placement p
		JOIN pg_dist_shard s USING (shardid) WHERE s.logicalrelid = 'd'::regclass`).Scan(&nodes); err != nil {
		t.Fatal(err)
	}
	if nodes != citustest.Workers() {
		t.Fatalf("the shards of a distributed table are on %d nodes, want %d", nodes, citustest.Workers())
	}
}

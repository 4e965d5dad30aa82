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

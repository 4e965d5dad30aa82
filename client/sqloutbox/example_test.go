package sqloutbox_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // a database/sql driver; lib/pq works alike

	"github.com/hipq/hipq/client"
	"github.com/hipq/hipq/client/internal/examplehipq"
	"github.com/hipq/hipq/client/sqloutbox"
)

func TestMain(m *testing.M) { examplehipq.Main(m) }

func ExampleEnqueueTx() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("HIPQ_EXAMPLE_DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer db.Close()

	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tx.Rollback() // after Commit, a no-op
	// ... the application's own writes ...
	job := client.Job{Type: "invoice.ship", Key: "shp_sql", Data: json.RawMessage(`{"order": 43}`)}
	if err := sqloutbox.EnqueueTx(ctx, tx, job); err != nil {
		fmt.Println(err)
		return
	}
	if err := tx.Commit(); err != nil { // the job exists if and only if this commits
		fmt.Println(err)
		return
	}
	fmt.Println("committed")
	// Output: committed
}

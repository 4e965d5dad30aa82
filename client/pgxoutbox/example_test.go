package pgxoutbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/client"
	"github.com/hipq/hipq/client/internal/examplehipq"
	"github.com/hipq/hipq/client/pgxoutbox"
)

func TestMain(m *testing.M) { examplehipq.Main(m) }

func ExampleEnqueueTx() {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, os.Getenv("HIPQ_EXAMPLE_DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close(ctx)

	tx, err := conn.Begin(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tx.Rollback(ctx) // after Commit, a no-op
	// ... the application's own writes: the order, its lines ...
	job := client.Job{Type: "invoice.ship", Key: "shp_pgx", Data: json.RawMessage(`{"order": 42}`)}
	err = pgxoutbox.EnqueueTx(ctx, tx, job, client.OutboxOptions{
		Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := tx.Commit(ctx); err != nil { // the job exists if and only if this commits
		fmt.Println(err)
		return
	}
	fmt.Println("committed")
	// Output: committed
}

// Package sqloutbox enqueues hipq jobs inside an application's own
// database/sql transaction (with any PostgreSQL driver: pgx's stdlib,
// lib/pq): the job exists if and only if the transaction commits.
//
// EnqueueTx writes one row into hipq's outbox table, hipq_intake; hipq's
// intake role turns it into a job within milliseconds of the commit, with
// the same defaults, validation and duplicate rules as a Kafka intake
// record. A row hipq cannot use becomes a dead letter (source outbox),
// never a failed commit.
//
// It needs the standard library and the client package only.
package sqloutbox

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/hipq/hipq/client"
)

// EnqueueTx writes job into hipq's outbox in tx. With options, o names the
// schema of hipq's tables and headers to send along.
func EnqueueTx(ctx context.Context, tx *sql.Tx, job client.Job, o ...client.OutboxOptions) error {
	var opts client.OutboxOptions
	if len(o) > 0 {
		opts = o[0]
	}
	row, err := client.NewOutboxRow(job, opts)
	if err != nil {
		return err
	}
	var headers any // a typed nil pointer is not NULL to every driver
	if row.Headers != nil {
		headers = *row.Headers
	}
	if _, err := tx.ExecContext(ctx, row.SQL, row.Value, headers); err != nil {
		return fmt.Errorf("hipq: enqueue %s/%s into the outbox: %w", job.Type, job.Key, err)
	}
	return nil
}

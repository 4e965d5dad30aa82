// Package pgxoutbox enqueues hipq jobs inside an application's own pgx
// transaction: the job exists if and only if the transaction commits.
//
// EnqueueTx writes one row into hipq's outbox table, hipq_intake; hipq's
// intake role turns it into a job within milliseconds of the commit (it
// wakes on a NOTIFY sent at commit), with the same defaults, validation
// and duplicate rules as a Kafka intake record. A row hipq cannot use
// becomes a dead letter (source outbox), never a failed commit.
//
// It needs pgx and the client package only.
package pgxoutbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/client"
)

// EnqueueTx writes job into hipq's outbox in tx. With options, o names the
// schema of hipq's tables and headers to send along.
func EnqueueTx(ctx context.Context, tx pgx.Tx, job client.Job, o ...client.OutboxOptions) error {
	var opts client.OutboxOptions
	if len(o) > 0 {
		opts = o[0]
	}
	row, err := client.NewOutboxRow(job, opts)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, row.SQL, row.Value, row.Headers); err != nil {
		return fmt.Errorf("hipq: enqueue %s/%s into the outbox: %w", job.Type, job.Key, err)
	}
	return nil
}

package store

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// TakeClaimLockForTest takes queue's claim lock in tx as a claim of a
// queue with limits takes it, on tx's node and, on Citus, on the queue's
// row.
func TakeClaimLockForTest(ctx context.Context, tx pgx.Tx, queue string) error {
	b := &pgx.Batch{}
	b.Queue(claimLockSQL, pgx.NamedArgs{"queue": queue})
	b.Queue(claimRowLockSQL, pgx.NamedArgs{"queue": queue})
	return tx.SendBatch(ctx, b).Close()
}

package store

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// OutboxRow is a row of hipq_intake, the transactional outbox.
type OutboxRow struct {
	ID        int64
	Value     []byte
	Headers   []byte // the headers column as JSON; nil when NULL
	CreatedAt time.Time
}

// OutboxDecide makes jobs and dead letters of outbox rows (in id order).
// It may not fail: what it cannot use is a dead letter.
type OutboxDecide func(rows []OutboxRow) (jobs []IntakeJob, dls []DeadLetter)

// OutboxApply takes rows of hipq_intake and applies what decide makes of
// them, all in one transaction: it deletes the rows (ids' when ids is not
// nil, else the oldest, limit at most), skipping any row another
// transaction holds (a drainer elsewhere, or the application's transaction
// still writing it), and writes the jobs under IntakeApply's duplicate and
// conflict rules, and the dead letters. It returns the ids it took (also
// when it fails: the transaction rolled back, so the rows are there still,
// for the caller to try apart). So a row becomes a job, or a dead letter,
// exactly once: its delete commits with its effect or not at all.
func (s *Store) OutboxApply(ctx context.Context, ids []int64, limit int, decide OutboxDecide) (taken []int64, res IntakeResult, err error) {
	err = s.inTx(ctx, func(tx pgx.Tx) error {
		taken, res = nil, IntakeResult{}
		var rows pgx.Rows
		var err error
		if ids != nil {
			rows, err = tx.Query(ctx, `
				DELETE FROM hipq_intake WHERE id IN (
				  SELECT id FROM hipq_intake WHERE id = ANY($1) ORDER BY id FOR UPDATE SKIP LOCKED)
				RETURNING id, convert_to(value, 'UTF8'), headers::text, created_at`, ids)
		} else {
			rows, err = tx.Query(ctx, `
				DELETE FROM hipq_intake WHERE id IN (
				  SELECT id FROM hipq_intake ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
				RETURNING id, convert_to(value, 'UTF8'), headers::text, created_at`, limit)
		}
		if err != nil {
			return fmt.Errorf("take outbox rows: %w", err)
		}
		var got []OutboxRow
		var r OutboxRow
		var headers *string
		if _, err := pgx.ForEachRow(rows, []any{&r.ID, &r.Value, &headers, &r.CreatedAt}, func() error {
			r.Headers = nil
			if headers != nil {
				r.Headers = []byte(*headers)
			}
			got = append(got, r)
			r = OutboxRow{}
			return nil
		}); err != nil {
			return fmt.Errorf("take outbox rows: %w", err)
		}
		if len(got) == 0 {
			return nil
		}
		slices.SortFunc(got, func(a, b OutboxRow) int { return cmp.Compare(a.ID, b.ID) })
		for _, r := range got {
			taken = append(taken, r.ID)
		}
		jobs, dls := decide(got)
		res, err = intakeWrite(ctx, tx, jobs, dls)
		return err
	})
	return taken, res, err
}

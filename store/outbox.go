package store

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// OutboxRow is a row of hipq_intake, the transactional outbox, as far as
// a drain reads it: a value or headers longer than the drain's bounds are
// cut (ValueSize and HeadersSize are their whole lengths), so no row, however
// large, can take a drainer's memory.
type OutboxRow struct {
	ID          int64
	Value       []byte
	ValueSize   int
	Headers     []byte // the headers column as JSON; nil when NULL
	HeadersSize int
	CreatedAt   time.Time
}

// OutboxDecide makes jobs and dead letters of outbox rows (in id order):
// what it cannot use is a dead letter. An error rolls the transaction
// back, so nothing is taken, and OutboxApply returns it.
type OutboxDecide func(rows []OutboxRow) (OutboxDecision, error)

// OutboxDecision is what a drain makes of its rows: jobs, dead letters,
// and rows PostgreSQL refused alone, tried again after the others (see
// IntakeRetry).
type OutboxDecision struct {
	Jobs        []IntakeJob
	DeadLetters []DeadLetter
	Retry       *IntakeRetry
}

// OutboxTake bounds what one drain transaction takes and reads.
type OutboxTake struct {
	IDs        []int64 // these rows; nil: the oldest
	Limit      int     // at most this many rows
	MaxValue   int     // read at most this many bytes of a value (the limit plus one)
	MaxHeaders int     // and of the headers' JSON text
	MaxBytes   int     // stop adding rows past this many bytes read (one row at least)
	// All takes IDs all together or none of them: when another
	// transaction holds one of them, nothing is taken (and nothing
	// applied).
	All bool
	// MustWrite: the rows must make a job, else the transaction rolls
	// back and OutboxApply returns ErrNoWrite (see IntakeBatch.MustWrite).
	MustWrite bool
}

// OutboxResult is what one drain transaction did.
type OutboxResult struct {
	IntakeResult
	// Taken are the ids of the rows it took, also when it failed: the
	// transaction rolled back, so the rows are there still, for the
	// caller to try apart.
	Taken []int64
	// More: it left rows it could have taken (it took Limit rows, or
	// stopped at MaxBytes): a drain goes on until a batch finds no more.
	More bool
}

// scanOutboxRows reads the n rows OutboxApply takes.
func scanOutboxRows(rows pgx.Rows, n int) ([]OutboxRow, error) {
	got := make([]OutboxRow, 0, n)
	var r OutboxRow
	var headers *string
	var headersSize *int
	_, err := pgx.ForEachRow(rows, []any{&r.ID, &r.Value, &r.ValueSize, &headers, &headersSize, &r.CreatedAt}, func() error {
		if headers != nil {
			r.Headers, r.HeadersSize = []byte(*headers), *headersSize
		}
		got = append(got, r)
		r = OutboxRow{}
		return nil
	})
	return got, err
}

// OutboxApply takes rows of hipq_intake and applies what decide makes of
// them, all in one transaction: it locks the rows (t.IDs' when given, else
// the oldest), skipping any row another transaction holds (a drainer
// elsewhere, or an application's transaction still writing it), deletes
// them, and writes the jobs under IntakeApply's duplicate and conflict
// rules, and the dead letters. So a row becomes a job, or a dead letter,
// exactly once: its delete commits with its effect or not at all.
func (s *Store) OutboxApply(ctx context.Context, t OutboxTake, decide OutboxDecide) (OutboxResult, error) {
	var taken []int64
	var res IntakeResult
	var more bool
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		taken, res, more = nil, IntakeResult{}, false
		// Lock first, reading sizes only, to take no more bytes than the
		// budget allows; rows locked and not taken are free again at commit.
		var rows pgx.Rows
		var err error
		if t.IDs != nil {
			rows, err = tx.Query(ctx, `SELECT id, octet_length(value) + coalesce(octet_length(headers::text), 0) FROM hipq_intake
				WHERE id = ANY($1) ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED`, t.IDs, t.Limit)
		} else {
			rows, err = tx.Query(ctx, `SELECT id, octet_length(value) + coalesce(octet_length(headers::text), 0) FROM hipq_intake
				ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`, t.Limit)
		}
		if err != nil {
			return fmt.Errorf("take outbox rows: %w", err)
		}
		var id, size int64
		budget := int64(t.MaxBytes)
		locked := 0
		if _, err := pgx.ForEachRow(rows, []any{&id, &size}, func() error {
			locked++
			if len(taken) > 0 && budget < min(size, int64(t.MaxValue+t.MaxHeaders)) {
				more = true
				return nil
			}
			budget -= min(size, int64(t.MaxValue+t.MaxHeaders))
			taken = append(taken, id)
			return nil
		}); err != nil {
			return fmt.Errorf("take outbox rows: %w", err)
		}
		more = more || locked == t.Limit
		if t.All && len(taken) < len(t.IDs) {
			taken = nil
		}
		if len(taken) == 0 {
			return nil
		}
		var got []OutboxRow
		const takenColumns = `id, substring(convert_to(value, 'UTF8') FROM 1 FOR $2), octet_length(value),
			          left(headers::text, $3), octet_length(headers::text), created_at`
		if distributedTx(tx) {
			// On Citus (hipq_intake in its metadata) RETURNING takes no
			// function that is not immutable, as convert_to is: the rows,
			// locked above, are read, then deleted.
			rows, err = tx.Query(ctx, `SELECT `+takenColumns+` FROM hipq_intake WHERE id = ANY($1) ORDER BY id`, taken, t.MaxValue, t.MaxHeaders)
			if err == nil {
				got, err = scanOutboxRows(rows, len(taken))
			}
			if err == nil {
				_, err = tx.Exec(ctx, `DELETE FROM hipq_intake WHERE id = ANY($1)`, taken)
			}
		} else {
			rows, err = tx.Query(ctx, `DELETE FROM hipq_intake WHERE id = ANY($1) RETURNING `+takenColumns, taken, t.MaxValue, t.MaxHeaders)
			if err == nil {
				got, err = scanOutboxRows(rows, len(taken))
			}
		}
		if err != nil {
			return fmt.Errorf("take outbox rows: %w", err)
		}
		slices.SortFunc(got, func(a, b OutboxRow) int { return cmp.Compare(a.ID, b.ID) })
		d, err := decide(got)
		if err != nil {
			return err
		}
		res, err = intakeWrite(ctx, tx, d.Jobs, d.DeadLetters, "")
		if err == nil && t.MustWrite && res.Inserted == 0 {
			err = ErrNoWrite
		}
		if err == nil && d.Retry != nil {
			err = intakeRetry(ctx, tx, d.Retry, &res)
		}
		return err
	})
	return OutboxResult{IntakeResult: res, Taken: taken, More: more}, err
}

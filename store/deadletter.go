package store

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// deadLettersInsert writes dead letters in one statement.
func deadLettersInsert(ctx context.Context, tx pgx.Tx, dls []DeadLetter) error {
	if len(dls) == 0 {
		return nil
	}
	n := len(dls)
	kinds, topics, reasons, headers := make([]string, n), make([]*string, n), make([]string, n), make([]string, n)
	parts, offs := make([]*int32, n), make([]*int64, n)
	keys, vals := make([][]byte, n), make([][]byte, n)
	recv := make([]*time.Time, n) // nil: now(), the clock retention compares with
	for i, d := range dls {
		kinds[i], reasons[i], headers[i] = d.Kind, safeText(d.Reason), headersJSON(d.Source.Headers)
		keys[i], vals[i] = d.Source.Key, d.Source.Value
		if !d.Source.Received.IsZero() {
			r := d.Source.Received
			recv[i] = &r
		}
		if d.Source.Topic != "" {
			t, p, o := d.Source.Topic, d.Source.Partition, d.Source.Offset
			topics[i], parts[i], offs[i] = &t, &p, &o
		}
	}
	_, err := tx.Exec(ctx, `
		INSERT INTO hipq_dead_letter (source, topic, kafka_partition, kafka_offset, record_key, record_value, headers, reason, received_at)
		SELECT s, t, p, o, k, v, h, r, coalesce(rc, now())
		FROM unnest(@source::text[], @topic::text[], @kafka_partition::int[], @kafka_offset::bigint[], @record_key::bytea[],
		            @record_value::bytea[], @headers::jsonb[], @reason::text[], @received_at::timestamptz[])
		  AS u(s, t, p, o, k, v, h, r, rc)`,
		pgx.StrictNamedArgs{"source": kinds, "topic": topics, "kafka_partition": parts, "kafka_offset": offs, "record_key": keys,
			"record_value": vals, "headers": headers, "reason": reasons, "received_at": recv})
	if err != nil {
		return fmt.Errorf("insert dead letters: %w", err)
	}
	return nil
}

// DeadLetterInsert records dead letters outside a consumer batch.
func (s *Store) DeadLetterInsert(ctx context.Context, dls []DeadLetter) error {
	return s.inTx(ctx, func(tx pgx.Tx) error { return deadLettersInsert(ctx, tx, dls) })
}

// DeadLetterListParams filters DeadLetterList.
type DeadLetterListParams struct {
	Kind    string // empty: all
	AfterID int64  // keyset cursor: ids below it (newest first); 0: from the newest
	Limit   int
}

// DeadLetterList lists dead letters, newest first.
func (s *Store) DeadLetterList(ctx context.Context, p DeadLetterListParams) ([]DeadLetter, error) {
	p.Limit = cmp.Or(p.Limit, DefaultListLimit)
	f := listFilter{}
	f.add("source", p.Kind)
	q, args := f.query(`SELECT `+deadLetterColumns+` FROM hipq_dead_letter`, p.AfterID, p.Limit)
	rows, err := s.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	out, err := scanDeadLetters(rows)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return out, nil
}

// DeadLetterGet returns one dead letter, or correlator.ErrNotFound.
func (s *Store) DeadLetterGet(ctx context.Context, id int64) (DeadLetter, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+deadLetterColumns+` FROM hipq_dead_letter WHERE id = $1`, id)
	if err != nil {
		return DeadLetter{}, fmt.Errorf("read dead letter %d: %w", id, err)
	}
	dls, err := scanDeadLetters(rows)
	if err != nil {
		return DeadLetter{}, fmt.Errorf("read dead letter %d: %w", id, err)
	}
	if len(dls) == 0 {
		return DeadLetter{}, correlator.ErrNotFound
	}
	return dls[0], nil
}

const deadLetterColumns = `id, source, coalesce(topic, ''), coalesce(kafka_partition, 0), coalesce(kafka_offset, 0),
	record_key, record_value, headers, reason, received_at, replayed_at`

func scanDeadLetters(rows pgx.Rows) ([]DeadLetter, error) {
	var out []DeadLetter
	var d DeadLetter
	var hdr []byte
	_, err := pgx.ForEachRow(rows, []any{&d.ID, &d.Kind, &d.Source.Topic, &d.Source.Partition, &d.Source.Offset,
		&d.Source.Key, &d.Source.Value, &hdr, &d.Reason, &d.Source.Received, &d.Replayed}, func() error {
		d.Source.Headers = decodeHeaders(hdr)
		out = append(out, d)
		return nil
	})
	return out, err
}

// ErrReplayed is returned when a dead letter was replayed already: a
// second replay could apply a reply to a later attempt, so it is refused.
var ErrReplayed = errors.New("the dead letter was replayed already")

// errStillDead rolls a replay back when its input is refused again.
var errStillDead = errors.New("still refused")

// deadLetterReplay runs fn in one transaction with setting the dead
// letter's replayed_at, guarded by replayed_at being null: two replays of
// one dead letter never both take effect. fn returning errStillDead rolls
// everything back and is no error.
func (s *Store) deadLetterReplay(ctx context.Context, id int64, fn func(pgx.Tx) error) error {
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		var replayed *time.Time
		err := tx.QueryRow(ctx, `SELECT replayed_at FROM hipq_dead_letter WHERE id = $1 FOR UPDATE`, id).Scan(&replayed)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return correlator.ErrNotFound
		case err != nil:
			return fmt.Errorf("lock dead letter %d: %w", id, err)
		case replayed != nil:
			return ErrReplayed
		}
		if err := fn(tx); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE hipq_dead_letter SET replayed_at = now() WHERE id = $1 AND replayed_at IS NULL`, id); err != nil {
			return fmt.Errorf("mark dead letter %d replayed: %w", id, err)
		}
		return nil
	})
	if errors.Is(err, errStillDead) {
		return nil
	}
	return err
}

// DeadLetterReplayIntake replays an intake dead letter as job j, the
// record decoded again (after a config fix). As at intake, a non-final job
// of the (type, key) with the same job_data makes it a duplicate (created
// false); one with other job_data is ErrConflict and changes nothing.
func (s *Store) DeadLetterReplayIntake(ctx context.Context, id int64, j *correlator.Job) (created bool, err error) {
	err = s.deadLetterReplay(ctx, id, func(tx pgx.Tx) error {
		inserted, _, conflicts, _, err := jobsAccept(ctx, tx, []IntakeJob{{Job: j}}, "")
		if err != nil {
			return err
		}
		if len(conflicts) > 0 {
			return ErrConflict
		}
		created = inserted == 1
		return nil
	})
	return created, err
}

// DeadLetterReplayReply replays a reply or callback dead letter: in goes
// through the reply table (SPEC §6) as if it had just arrived. When it
// would be dead-lettered again nothing changes (no second dead letter,
// replayed_at stays null) and the result says why.
func (s *Store) DeadLetterReplayReply(ctx context.Context, id int64, in ReplyIn, types correlator.Types, earlyTTL time.Duration) (ReplyResult, error) {
	var res ReplyResult
	err := s.deadLetterReplay(ctx, id, func(tx pgx.Tx) error {
		var err error
		if res, err = applyReplies(ctx, tx, s.events, []ReplyIn{in}, types, earlyTTL, time.Time{}); err != nil {
			return err
		}
		if res.Verdicts[0] == correlator.DeadLetter {
			return errStillDead
		}
		return nil
	})
	return res, err
}

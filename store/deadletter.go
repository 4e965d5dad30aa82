package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
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
	recv := make([]time.Time, n)
	for i, d := range dls {
		kinds[i], reasons[i], headers[i] = d.Kind, d.Reason, headersJSON(d.Source.Headers)
		keys[i], vals[i] = d.Source.Key, d.Source.Value
		recv[i] = d.Source.Received
		if recv[i].IsZero() {
			recv[i] = time.Now()
		}
		if d.Source.Topic != "" {
			t, p, o := d.Source.Topic, d.Source.Partition, d.Source.Offset
			topics[i], parts[i], offs[i] = &t, &p, &o
		}
	}
	_, err := tx.Exec(ctx, `
		INSERT INTO hipq_dead_letter (source, topic, kafka_partition, kafka_offset, record_key, record_value, headers, reason, received_at)
		SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::bigint[], $5::bytea[], $6::bytea[], $7::jsonb[], $8::text[], $9::timestamptz[])`,
		kinds, topics, parts, offs, keys, vals, headers, reasons, recv)
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
	if p.Limit <= 0 {
		p.Limit = 100
	}
	rows, err := s.pool.Query(ctx, `
		SELECT id, source, coalesce(topic, ''), coalesce(kafka_partition, 0), coalesce(kafka_offset, 0),
		       record_key, record_value, headers, reason, received_at, replayed_at
		FROM hipq_dead_letter
		WHERE ($1 = '' OR source = $1) AND ($2 = 0 OR id < $2)
		ORDER BY id DESC LIMIT $3`, p.Kind, p.AfterID, p.Limit)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	var out []DeadLetter
	var d DeadLetter
	var hdr []byte
	_, err = pgx.ForEachRow(rows, []any{&d.ID, &d.Kind, &d.Source.Topic, &d.Source.Partition, &d.Source.Offset,
		&d.Source.Key, &d.Source.Value, &hdr, &d.Reason, &d.Source.Received, &d.Replayed}, func() error {
		d.Source.Headers = decodeHeaders(hdr)
		out = append(out, d)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return out, nil
}

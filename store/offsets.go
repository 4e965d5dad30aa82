package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// OffsetsLoad returns the stored next offsets of the given partitions for a
// consumer group; partitions with none stored are absent.
func (s *Store) OffsetsLoad(ctx context.Context, group string, tps []TopicPartition) (map[TopicPartition]int64, error) {
	topics := make([]string, len(tps))
	parts := make([]int32, len(tps))
	for i, tp := range tps {
		topics[i], parts[i] = tp.Topic, tp.Partition
	}
	rows, err := s.pool.Query(ctx, `
		SELECT o.topic, o.kafka_partition, o.next_offset
		FROM hipq_offset o JOIN unnest($2::text[], $3::int[]) AS t(topic, part)
		  ON o.topic = t.topic AND o.kafka_partition = t.part
		WHERE o.consumer_group = $1`, group, topics, parts)
	if err != nil {
		return nil, fmt.Errorf("load offsets: %w", err)
	}
	out := map[TopicPartition]int64{}
	var tp TopicPartition
	var next int64
	_, err = pgx.ForEachRow(rows, []any{&tp.Topic, &tp.Partition, &next}, func() error {
		out[tp] = next
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("load offsets: %w", err)
	}
	return out, nil
}

// offsetsAdvance queues on b, the batch that opens the effect's
// transaction (inTxOpen), the compare-and-set of invariant 7. It runs first
// in that transaction, so it also takes the partitions' row locks: a second
// instance applying the same records waits, then finds the offset moved,
// and its try ends with ErrOffsetConflict (rolled back).
func offsetsAdvance(b *pgx.Batch, group string, adv []OffsetAdvance) {
	if len(adv) == 0 {
		return
	}
	topics := make([]string, len(adv))
	parts := make([]int32, len(adv))
	from := make([]int64, len(adv))
	to := make([]int64, len(adv))
	for i, a := range adv {
		topics[i], parts[i], from[i], to[i] = a.Topic, a.Partition, a.From, a.To
	}
	b.Queue(`
		WITH adv AS (
		  SELECT * FROM unnest($2::text[], $3::int[], $4::bigint[], $5::bigint[]) AS a(topic, part, from_off, to_off)
		), upd AS (
		  UPDATE hipq_offset o SET next_offset = a.to_off
		  FROM adv a
		  WHERE a.from_off >= 0 AND o.consumer_group = $1 AND o.topic = a.topic
		    AND o.kafka_partition = a.part AND o.next_offset = a.from_off
		  RETURNING 1
		), ins AS (
		  INSERT INTO hipq_offset (consumer_group, topic, kafka_partition, next_offset)
		  SELECT $1, topic, part, to_off FROM adv WHERE from_off < 0
		  ON CONFLICT DO NOTHING
		  RETURNING 1
		)
		SELECT (SELECT count(*) FROM upd) + (SELECT count(*) FROM ins)`,
		group, topics, parts, from, to).QueryRow(func(row pgx.Row) error {
		var n int
		if err := row.Scan(&n); err != nil {
			return fmt.Errorf("advance offsets: %w", err)
		}
		if n != len(adv) {
			return ErrOffsetConflict
		}
		return nil
	})
}

package store

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// The dashboard's reads. Each stays cheap however many final rows
// retention keeps: counts cover non-final jobs only (partial indexes),
// the chart reads hipq_activity (a row per instance, queue and minute),
// dead letters their received_at index, and the final rows are an
// estimate from the planner's statistics.

// QueueCount is the non-final jobs of one queue in one state.
type QueueCount struct {
	Queue string
	State string
	N     int64
	// Weight is the sum of their throttle_factor.
	Weight int64
}

// QueueCounts counts the non-final jobs by queue and state, through the
// partial index of non-final jobs: never the final rows retention keeps
// (a scan of millions).
func (s *Store) QueueCounts(ctx context.Context) ([]QueueCount, error) {
	rows, err := s.pool.Query(ctx, `SELECT queue, state::text, count(*), coalesce(sum(throttle_factor), 0)
		FROM hipq_job WHERE state <> 'final' GROUP BY 1, 2 ORDER BY 1, 2`)
	if err != nil {
		return nil, fmt.Errorf("count non-final jobs: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (QueueCount, error) {
		var c QueueCount
		err := r.Scan(&c.Queue, &c.State, &c.N, &c.Weight)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("count non-final jobs: %w", err)
	}
	return out, nil
}

// FinalEstimate is the planner's estimate of the final rows kept
// (reltuples less the non-final count), never a scan; -1 when unknown.
func (s *Store) FinalEstimate(ctx context.Context, nonFinal int64) (int64, error) {
	var est float64
	err := s.pool.QueryRow(ctx, `SELECT reltuples FROM pg_class WHERE oid = to_regclass('hipq_job')`).Scan(&est)
	if err != nil {
		return 0, fmt.Errorf("estimate final jobs: %w", err)
	}
	if est < 0 {
		return -1, nil // never analyzed
	}
	return max(int64(est)-nonFinal, 0), nil
}

// RunningWeights sums the throttle_factor of a queue's running jobs by
// the value of job_data #>> path (the empty string when missing).
func (s *Store) RunningWeights(ctx context.Context, queue string, path []string) (map[string]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT coalesce(job_data #>> $2::text[], ''), sum(throttle_factor)
		FROM hipq_job WHERE queue = $1 AND state = 'running' GROUP BY 1`, queue, path)
	if err != nil {
		return nil, fmt.Errorf("running weight of queue %q: %w", queue, err)
	}
	out := map[string]int64{}
	var k string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&k, &n}, func() error { out[k] = n; return nil }); err != nil {
		return nil, fmt.Errorf("running weight of queue %q: %w", queue, err)
	}
	return out, nil
}

// QueuesPaused returns the paused queues.
func (s *Store) QueuesPaused(ctx context.Context) (map[string]bool, error) {
	rows, err := s.pool.Query(ctx, `SELECT name FROM hipq_queue WHERE paused`)
	if err != nil {
		return nil, fmt.Errorf("paused queues: %w", err)
	}
	out := map[string]bool{}
	var name string
	if _, err := pgx.ForEachRow(rows, []any{&name}, func() error { out[name] = true; return nil }); err != nil {
		return nil, fmt.Errorf("paused queues: %w", err)
	}
	return out, nil
}

// DeadLettersSince counts dead letters received since t, by source.
func (s *Store) DeadLettersSince(ctx context.Context, t time.Time) (map[string]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT source, count(*) FROM hipq_dead_letter WHERE received_at >= $1 GROUP BY 1`, t)
	if err != nil {
		return nil, fmt.Errorf("count dead letters: %w", err)
	}
	out := map[string]int64{}
	var src string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&src, &n}, func() error { out[src] = n; return nil }); err != nil {
		return nil, fmt.Errorf("count dead letters: %w", err)
	}
	return out, nil
}

// Activity is what one queue did in one minute, over every instance.
type Activity struct {
	Minute     time.Time
	Queue      string
	Dispatched int64
	Replied    int64
}

// ActivityAdd adds an instance's counts to their minutes and prunes the
// rows older than a day, in one transaction.
func (s *Store) ActivityAdd(ctx context.Context, instance string, as []Activity) error {
	minutes := make([]time.Time, len(as))
	queues := make([]string, len(as))
	sent := make([]int64, len(as))
	replied := make([]int64, len(as))
	for i, a := range as {
		minutes[i], queues[i], sent[i], replied[i] = a.Minute.Truncate(time.Minute), a.Queue, a.Dispatched, a.Replied
	}
	return s.inTx(ctx, func(tx pgx.Tx) error {
		if distributedTx(tx) {
			return activityAddDistributed(ctx, tx, instance, as)
		}
		if len(as) > 0 {
			if _, err := tx.Exec(ctx, `INSERT INTO hipq_activity AS a (minute, instance, queue, dispatched, replied)
				SELECT m, $1, q, d, r FROM unnest($2::timestamptz[], $3::text[], $4::bigint[], $5::bigint[]) AS x(m, q, d, r)
				ON CONFLICT (minute, instance, queue) DO UPDATE
				SET dispatched = a.dispatched + excluded.dispatched, replied = a.replied + excluded.replied`,
				instance, minutes, queues, sent, replied); err != nil {
				return fmt.Errorf("add activity: %w", err)
			}
		}
		if _, err := tx.Exec(ctx, `DELETE FROM hipq_activity WHERE minute < now() - interval '25 hours'`); err != nil {
			return fmt.Errorf("prune activity: %w", err)
		}
		return nil
	})
}

// activityAddDistributed is ActivityAdd's writes on Citus, where
// hipq_activity is distributed by queue: each row is added by a statement
// of its own naming its queue, and the prune reads which queues have rows
// past a day (a read of every shard) and deletes each one's by its queue,
// so that every write is one queue's (docs/scaling.md). Queues go in the
// order of their names' bytes, in one transaction.
func activityAddDistributed(ctx context.Context, tx pgx.Tx, instance string, as []Activity) error {
	as = slices.Clone(as)
	for i := range as {
		as[i].Minute = as[i].Minute.Truncate(time.Minute)
	}
	slices.SortFunc(as, func(x, y Activity) int {
		return cmp.Or(strings.Compare(x.Queue, y.Queue), x.Minute.Compare(y.Minute))
	})
	b := &pgx.Batch{}
	for _, a := range as {
		b.Queue(`INSERT INTO hipq_activity AS a (minute, instance, queue, dispatched, replied) VALUES ($1, $2, $3, $4, $5)
			ON CONFLICT (minute, instance, queue) DO UPDATE
			SET dispatched = a.dispatched + excluded.dispatched, replied = a.replied + excluded.replied`,
			a.Minute, instance, a.Queue, a.Dispatched, a.Replied)
	}
	if b.Len() > 0 {
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("add activity: %w", err)
		}
	}
	rows, err := tx.Query(ctx, `SELECT DISTINCT queue FROM hipq_activity WHERE minute < now() - interval '25 hours'`)
	if err != nil {
		return fmt.Errorf("prune activity: %w", err)
	}
	queues, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("prune activity: %w", err)
	}
	slices.Sort(queues)
	b = &pgx.Batch{}
	for _, q := range queues {
		b.Queue(`DELETE FROM hipq_activity WHERE queue = $1 AND minute < now() - interval '25 hours'`, q)
	}
	if b.Len() > 0 {
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("prune activity: %w", err)
		}
	}
	return nil
}

// ActivitySince sums every instance's activity per queue and minute
// since t, oldest first.
func (s *Store) ActivitySince(ctx context.Context, t time.Time) ([]Activity, error) {
	rows, err := s.pool.Query(ctx, `SELECT minute, queue, sum(dispatched)::bigint, sum(replied)::bigint
		FROM hipq_activity WHERE minute >= $1 GROUP BY 1, 2 ORDER BY 1, 2`, t.Truncate(time.Minute))
	if err != nil {
		return nil, fmt.Errorf("read activity: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Activity, error) {
		var a Activity
		err := r.Scan(&a.Minute, &a.Queue, &a.Dispatched, &a.Replied)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("read activity: %w", err)
	}
	return out, nil
}

// Offset is a consumer group's next offset of one partition.
type Offset struct {
	Group string
	TopicPartition
	Next int64
}

// OffsetsAll returns every stored offset.
func (s *Store) OffsetsAll(ctx context.Context) ([]Offset, error) {
	rows, err := s.pool.Query(ctx, `SELECT consumer_group, topic, kafka_partition, next_offset FROM hipq_offset
		ORDER BY 1, 2, 3`)
	if err != nil {
		return nil, fmt.Errorf("read offsets: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Offset, error) {
		var o Offset
		err := r.Scan(&o.Group, &o.Topic, &o.Partition, &o.Next)
		return o, err
	})
	if err != nil {
		return nil, fmt.Errorf("read offsets: %w", err)
	}
	return out, nil
}

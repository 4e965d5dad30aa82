package store

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"github.com/jackc/pgx/v5"
)

// Every statement that writes or locks rows of hipq_job or hipq_attempt
// names one queue (queue = $n), so that with the tables distributed by
// queue (Citus, docs/scaling.md) each is a single-shard statement.
// Batches that span queues are written one queue at a time, in queue
// order, in the caller's transaction; reads that only find what to do may
// span queues. TestEveryWriteNamesItsQueue checks every statement of the
// claim, send, reply and sweep paths.

// perQueue calls fn for each queue of xs, in name order, with the
// elements of that queue in their order. An element naming no queue is
// refused: its statements would match nothing and move nothing, silently.
func perQueue[T any](xs []T, queueOf func(T) string, fn func(queue string, xs []T) error) error {
	if len(xs) == 0 {
		return nil
	}
	first := queueOf(xs[0])
	one := true
	for _, x := range xs {
		q := queueOf(x)
		if q == "" {
			return fmt.Errorf("an entry of %d names no queue (a bug: every claimed job has one)", len(xs))
		}
		one = one && q == first
	}
	if one { // the common case: no copy
		return fn(first, xs)
	}
	groups := map[string][]T{}
	for _, x := range xs {
		groups[queueOf(x)] = append(groups[queueOf(x)], x)
	}
	for _, q := range slices.Sorted(maps.Keys(groups)) {
		if err := fn(q, groups[q]); err != nil {
			return err
		}
	}
	return nil
}

func refQueue(r AttemptRef) string { return r.Queue }

// JobsElsewhere is the count of one job type's non-final jobs in one
// queue other than the type's configured one.
type JobsElsewhere struct {
	JobType string
	Queue   string // the queue the jobs are in
	Count   int64
}

// NonFinalElsewhere counts, for each job type of queueOf (a type's name to
// its configured queue), the type's non-final jobs in any other queue, by
// type and queue, in that order. One non-final job per type and key is
// kept by a unique key that, on Citus, holds per queue only: a type whose
// queue changes while it has non-final jobs could get a second one in its
// new queue (and replies look for a job in its type's queue first). It
// reads every queue, and finds nothing in a database not migrated yet.
func (s *Store) NonFinalElsewhere(ctx context.Context, queueOf map[string]string) ([]JobsElsewhere, error) {
	types := slices.Sorted(maps.Keys(queueOf))
	queues := make([]string, len(types))
	for i, t := range types {
		queues[i] = queueOf[t]
	}
	var migrated bool
	if err := s.pool.QueryRow(ctx, "SELECT to_regclass('hipq_job') IS NOT NULL").Scan(&migrated); err != nil {
		return nil, fmt.Errorf("count jobs outside their type's queue: %w", err)
	}
	if !migrated || len(types) == 0 {
		return nil, nil
	}
	// $2 holds each type's queue at its type's position in $1.
	rows, err := s.pool.Query(ctx, `SELECT job_type, queue, count(*) FROM hipq_job
		WHERE state <> 'final' AND job_type = ANY($1::text[])
			AND queue <> ($2::text[])[array_position($1::text[], job_type)]
		GROUP BY job_type, queue ORDER BY job_type, queue`, types, queues)
	if err != nil {
		return nil, fmt.Errorf("count jobs outside their type's queue: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[JobsElsewhere])
	if err != nil {
		return nil, fmt.Errorf("count jobs outside their type's queue: %w", err)
	}
	return out, nil
}

package store

import (
	"fmt"
	"maps"
	"slices"
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

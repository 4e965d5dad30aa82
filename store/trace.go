package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// Trace contexts are read and written only while tracing is on: with it
// off, none of these statements runs. They are hints: each is given up
// after traceTimeout rather than hold a send or a reply while PostgreSQL
// is slow or away.
const traceTimeout = 2 * time.Second

// jobTracesSQL reads the trace contexts of jobs of one queue ($1) by id
// ($2). Naming the queue routes the read to the queue's shard on Citus
// and makes it probes of the primary key there, (queue, id): by id alone
// it read every shard of hipq_job, each all through.
const jobTracesSQL = `SELECT id, trace_parent, coalesce(trace_state, '') FROM hipq_job
	WHERE queue = $1 AND id = ANY($2) AND trace_parent IS NOT NULL`

// JobTraces returns the trace contexts of those of the jobs that have one,
// by job id (one statement per queue of jobs).
func (s *Store) JobTraces(ctx context.Context, jobs []AttemptRef) (map[int64]correlator.TraceContext, error) {
	ctx, cancel := context.WithTimeout(ctx, traceTimeout)
	defer cancel()
	out := map[int64]correlator.TraceContext{}
	err := perQueue(jobs, refQueue, func(q string, jobs []AttemptRef) error {
		ids, _ := refArrays(jobs)
		rows, err := s.pool.Query(ctx, jobTracesSQL, q, ids)
		if err != nil {
			return err
		}
		var id int64
		var tc correlator.TraceContext
		_, err = pgx.ForEachRow(rows, []any{&id, &tc.Parent, &tc.State}, func() error { out[id] = tc; return nil })
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("read trace contexts: %w", err)
	}
	return out, nil
}

// AttemptTrace is the traceparent of one attempt's send span.
type AttemptTrace struct {
	AttemptRef
	Parent string
}

// attemptTracesSQL reads the send spans' traceparents of attempts of one
// queue ($1), by job id and attempt ($2, $3), each with its place in the
// lists. (The queue, as in jobTracesSQL: on Citus the primary key is
// (queue, job_id, attempt).)
const attemptTracesSQL = `SELECT u.ord, a.trace_parent
	FROM hipq_attempt a JOIN unnest($2::bigint[], $3::int[]) WITH ORDINALITY AS u(id, att, ord) ON a.job_id = u.id AND a.attempt = u.att
	WHERE a.queue = $1 AND a.trace_parent IS NOT NULL`

// AttemptTraces returns the send spans' traceparents of those of the
// attempts that have one (one statement per queue of refs).
func (s *Store) AttemptTraces(ctx context.Context, refs []AttemptRef) (map[AttemptRef]string, error) {
	ctx, cancel := context.WithTimeout(ctx, traceTimeout)
	defer cancel()
	out := map[AttemptRef]string{}
	err := perQueue(refs, refQueue, func(q string, refs []AttemptRef) error {
		ids, atts := refArrays(refs)
		rows, err := s.pool.Query(ctx, attemptTracesSQL, q, ids, atts)
		if err != nil {
			return err
		}
		var ord int
		var p string
		_, err = pgx.ForEachRow(rows, []any{&ord, &p}, func() error { out[refs[ord-1]] = p; return nil })
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("read attempt trace contexts: %w", err)
	}
	return out, nil
}

// AttemptTracesWrite keeps the send spans' contexts on their attempts.
// The dispatcher writes them before it sends, so a reply, which can only
// follow its request, always finds its parent. Like every writer of
// attempt rows it locks their jobs first, in (queue, id) order: a write
// that outlived its timeout on the server would otherwise give an attempt
// a new version under a sent mark that names the one it found (by tuple
// id), and the mark would be lost (the claim then undone and sent again).
func (s *Store) AttemptTracesWrite(ctx context.Context, ts []AttemptTrace) error {
	if len(ts) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, traceTimeout)
	defer cancel()
	refs := make([]AttemptRef, len(ts))
	for i, t := range ts {
		refs[i] = t.AttemptRef
	}
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		if err := lockJobs(ctx, tx, refs); err != nil {
			return err
		}
		return perQueue(ts, func(t AttemptTrace) string { return t.Queue }, func(q string, ts []AttemptTrace) error {
			ids, atts, ps := make([]int64, len(ts)), make([]int32, len(ts)), make([]string, len(ts))
			for i, t := range ts {
				ids[i], atts[i], ps[i] = t.JobID, int32(t.Attempt), t.Parent
			}
			_, err := tx.Exec(ctx, `UPDATE hipq_attempt a SET trace_parent = u.tp
				FROM unnest($1::bigint[], $2::int[], $3::text[], $5::timestamptz[]) AS u(id, att, tp, claim)
				WHERE a.queue = $4 AND a.job_id = u.id AND a.attempt = u.att
				  AND (u.claim IS NULL OR a.dispatched_at = u.claim)`,
				ids, atts, ps, q, claimsOf(ts, func(t AttemptTrace) time.Time { return t.Claim }))
			return err
		})
	})
	if err != nil {
		return fmt.Errorf("record send spans: %w", err)
	}
	return nil
}

package store

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// earlyQueueOf is the queue an early reply is kept under: its job's, when
// it has one (a job not dispatched yet), else the one its sender knew,
// else its type's here. (A reply whose type is not configured here is
// dead-lettered, never kept.) Its job, claimed, is of that queue, so the
// reply is found beside the job's own rows (earlyByJobCitusSQL).
func earlyQueueOf(in ReplyIn, target *correlator.Target, types correlator.Types) string {
	if target != nil {
		return target.Queue
	}
	if in.Queue != "" {
		return in.Queue
	}
	if jt := types.Get(in.Reply.JobType); jt != nil {
		return jt.Queue
	}
	return ""
}

func earlyReplyQueue(in ReplyIn) string { return in.earlyQueue }

// earlyInsert keeps early replies, each until its expires, under its
// queue: in one statement, on Citus one per queue (each then goes to that
// queue's shard).
func earlyInsert(ctx context.Context, tx pgx.Tx, early []ReplyIn) error {
	if len(early) == 0 {
		return nil
	}
	var err error
	if distributedTx(tx) {
		err = perQueue(early, earlyReplyQueue, func(_ string, early []ReplyIn) error { return earlyInsertRows(ctx, tx, early) })
	} else {
		err = earlyInsertRows(ctx, tx, early)
	}
	if err != nil {
		return fmt.Errorf("keep early replies: %w", err)
	}
	return nil
}

func earlyInsertRows(ctx context.Context, tx pgx.Tx, early []ReplyIn) error {
	n := len(early)
	queues, types, keys, errs, replies, headers, kinds := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	jobIDs := make([]*int64, n)
	atts := make([]*int32, n)
	succ, retry := make([]bool, n), make([]bool, n)
	topics := make([]*string, n)
	parts := make([]*int32, n)
	offs := make([]*int64, n)
	rkeys, rvals := make([][]byte, n), make([][]byte, n)
	exp := make([]time.Time, n)
	retryAt, retryIn := make([]*time.Time, n), make([]*float64, n)
	for i, in := range early {
		r := in.Reply
		if in.earlyQueue == "" {
			return fmt.Errorf("an early reply of %s/%s has no queue (a bug: its type is configured)", r.JobType, r.JobKey)
		}
		queues[i], types[i], keys[i], errs[i], kinds[i] = in.earlyQueue, r.JobType, r.JobKey, r.Error, in.Kind
		replies[i] = string(r.Result)
		if replies[i] == "" {
			replies[i] = "null"
		}
		headers[i] = headersJSON(in.Source.Headers)
		jobIDs[i] = r.JobID
		if r.Attempt != nil {
			a := int32(*r.Attempt)
			atts[i] = &a
		}
		succ[i], retry[i] = r.Success, r.Retryable
		if in.Source.Topic != "" {
			t, p, o := in.Source.Topic, in.Source.Partition, in.Source.Offset
			topics[i], parts[i], offs[i] = &t, &p, &o
		}
		rkeys[i], rvals[i], exp[i] = in.Source.Key, in.Source.Value, in.expires
		switch ra := r.RetryAfter; {
		case !ra.At.IsZero():
			retryAt[i] = &ra.At
		case ra.Delay > 0:
			secs := ra.Delay.Seconds()
			retryIn[i] = &secs
		}
	}
	_, err := tx.Exec(ctx, `
		INSERT INTO hipq_early_reply (queue, job_type, job_key, job_id, attempt, success, retryable, error_text, reply, headers,
		                              source, topic, kafka_partition, kafka_offset, record_key, record_value, expires_at, retry_at)
		SELECT q, t, k, id, att, ok, rt, err, rep, hdr, src, top, part, off, rk, rv, exp,
		       -- a delay counts from the reply's arrival, on the database's clock
		       coalesce(rat, now() + make_interval(secs => rin))
		FROM unnest(@queue::text[], @job_type::text[], @job_key::text[], @job_id::bigint[], @attempt::int[], @success::bool[], @retryable::bool[],
		            @error_text::text[], @reply::jsonb[], @headers::jsonb[], @source::text[], @topic::text[], @kafka_partition::int[],
		            @kafka_offset::bigint[], @record_key::bytea[], @record_value::bytea[], @expires_at::timestamptz[],
		            @retry_at::timestamptz[], @retry_in::float8[])
		  AS u(q, t, k, id, att, ok, rt, err, rep, hdr, src, top, part, off, rk, rv, exp, rat, rin)`,
		pgx.StrictNamedArgs{
			"queue": queues, "job_type": types, "job_key": keys, "job_id": jobIDs, "attempt": atts, "success": succ, "retryable": retry,
			"error_text": errs, "reply": replies, "headers": headers, "source": kinds, "topic": topics, "kafka_partition": parts,
			"kafka_offset": offs, "record_key": rkeys, "record_value": rvals, "expires_at": exp,
			"retry_at": retryAt, "retry_in": retryIn, // one of the two, or neither
		})
	return err
}

// earlyDelete deletes the kept early replies used up (applied,
// dead-lettered, or found duplicate or stale: decided, no longer early):
// by id, on Citus by queue and id, one statement per queue.
func earlyDelete(ctx context.Context, tx pgx.Tx, used []ReplyIn) error {
	if len(used) == 0 {
		return nil
	}
	ids := func(used []ReplyIn) []int64 {
		out := make([]int64, len(used))
		for i, in := range used {
			out[i] = in.earlyID
		}
		return out
	}
	var err error
	if distributedTx(tx) {
		err = perQueue(used, earlyReplyQueue, func(q string, used []ReplyIn) error {
			_, err := tx.Exec(ctx, "DELETE FROM hipq_early_reply WHERE queue = $2 AND id = ANY($1)", ids(used), q)
			return err
		})
	} else {
		_, err = tx.Exec(ctx, "DELETE FROM hipq_early_reply WHERE id = ANY($1)", ids(used))
	}
	if err != nil {
		return fmt.Errorf("delete early replies: %w", err)
	}
	return nil
}

// EarlyReplyApply re-checks the kept early replies for the given jobs
// (just sent): by (type, key) or by job id. Replies now applicable are
// applied; those past their TTL are dead-lettered.
func (s *Store) EarlyReplyApply(ctx context.Context, sent []AttemptRef, types correlator.Types) (ReplyResult, error) {
	var res ReplyResult
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		var err error
		res, _, err = earlyReplyApply(ctx, tx, s.events, sent, 0, 0, types)
		return err
	})
	return res, err
}

// EarlyReplySweep re-checks one page of kept early replies: up to limit
// of those with an id above after, in id order, in one transaction. It
// returns what became of them and the last id it looked at (0: the page
// was empty), so a sweep pages through every one of them.
func (s *Store) EarlyReplySweep(ctx context.Context, after int64, limit int, types correlator.Types) (ReplyResult, int64, error) {
	var res ReplyResult
	var last int64
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		var err error
		res, last, err = earlyReplyApply(ctx, tx, s.events, nil, after, limit, types)
		return err
	})
	return res, last, err
}

func earlyReplyApply(ctx context.Context, tx pgx.Tx, ev *Events, sent []AttemptRef, after int64, limit int, types correlator.Types) (ReplyResult, int64, error) {
	var res ReplyResult
	var last int64
	var ins []ReplyIn
	load := func(queue, q string, args ...any) error {
		var err error
		ins, last, err = earlyLoad(ctx, tx, ins, queue, q, args...)
		return err
	}
	dist := distributedTx(tx)
	var err error
	switch {
	case sent != nil:
		byJob := earlyByJobSQL
		if dist {
			byJob = earlyByJobCitusSQL
		}
		err = perQueue(sent, refQueue, func(q string, refs []AttemptRef) error {
			ids, _ := refArrays(refs)
			// A reply kept by job id has no type or key: it is found by its id.
			return load(q, byJob, ids, q)
		})
	case dist:
		ins, last, err = earlyPageCitus(ctx, tx, after, limit)
	default:
		err = load("", earlyPageSQL, after, limit)
	}
	if err != nil {
		return res, 0, fmt.Errorf("load early replies: %w", err)
	}
	res, err = applyReplies(ctx, tx, ev, ins, types, 0, time.Time{})
	if err != nil {
		return res, 0, err
	}
	return res, last, deadLettersInsert(ctx, tx, res.DeadLetters)
}

const earlyColumns = `SELECT e.id, coalesce(e.queue, ''), e.job_type, e.job_key, e.job_id, e.attempt, e.success, e.retryable, e.error_text,
	             e.reply, e.headers, e.source, coalesce(e.topic, ''), coalesce(e.kafka_partition, 0), coalesce(e.kafka_offset, 0),
	             e.record_key, e.record_value, e.received_at, e.expires_at, e.retry_at
	      FROM hipq_early_reply e `

// earlyByJobSQL loads the kept replies for jobs $1 of queue $2.
const earlyByJobSQL = earlyColumns + `
	WHERE e.id IN (SELECT e2.id FROM hipq_early_reply e2 JOIN hipq_job j
	                 ON j.job_type = e2.job_type AND j.job_key = e2.job_key WHERE j.queue = $2 AND j.id = ANY($1)
	               UNION
	               SELECT e3.id FROM hipq_early_reply e3 WHERE e3.job_id = ANY($1))
	ORDER BY e.id FOR UPDATE OF e SKIP LOCKED`

// earlyByJobCitusSQL is earlyByJobSQL on Citus: every table read by
// queue $2, so that it runs on that queue's shards, where its jobs' early
// replies are kept.
const earlyByJobCitusSQL = earlyColumns + `
	WHERE e.queue = $2
	  AND e.id IN (SELECT e2.id FROM hipq_early_reply e2 JOIN hipq_job j
	                 ON j.queue = e2.queue AND j.job_type = e2.job_type AND j.job_key = e2.job_key
	               WHERE e2.queue = $2 AND j.queue = $2 AND j.id = ANY($1)
	               UNION
	               SELECT e3.id FROM hipq_early_reply e3 WHERE e3.queue = $2 AND e3.job_id = ANY($1))
	ORDER BY e.id FOR UPDATE OF e SKIP LOCKED`

// earlyPageSQL loads up to $2 kept replies of ids above $1.
const earlyPageSQL = earlyColumns + `WHERE e.id > $1 ORDER BY e.id LIMIT $2 FOR UPDATE SKIP LOCKED`

// earlyPageCitus is earlyPageSQL on Citus, which locks rows of one shard
// only: the page's replies are found by a read over every queue, then
// locked and loaded queue by queue, in name order. The last id is the
// page's.
func earlyPageCitus(ctx context.Context, tx pgx.Tx, after int64, limit int) ([]ReplyIn, int64, error) {
	rows, err := tx.Query(ctx, `SELECT queue, id FROM hipq_early_reply WHERE id > $1 ORDER BY id LIMIT $2`, after, limit)
	if err != nil {
		return nil, 0, err
	}
	type kept struct {
		queue string
		id    int64
	}
	var page []kept
	var k kept
	if _, err := pgx.ForEachRow(rows, []any{&k.queue, &k.id}, func() error { page = append(page, k); return nil }); err != nil {
		return nil, 0, err
	}
	if len(page) == 0 {
		return nil, 0, nil
	}
	var ins []ReplyIn
	err = perQueue(page, func(k kept) string { return k.queue }, func(q string, page []kept) error {
		ids := make([]int64, len(page))
		for i, k := range page {
			ids[i] = k.id
		}
		var err error
		ins, _, err = earlyLoad(ctx, tx, ins, "", earlyColumns+`WHERE e.queue = $1 AND e.id = ANY($2) ORDER BY e.id FOR UPDATE SKIP LOCKED`, q, ids)
		return err
	})
	return ins, page[len(page)-1].id, err
}

// earlyLoad appends to ins the kept replies q selects (replies to jobs of
// queue, when it is not ""), and says the last id.
func earlyLoad(ctx context.Context, tx pgx.Tx, ins []ReplyIn, queue, q string, args ...any) ([]ReplyIn, int64, error) {
	var last int64
	rows, err := tx.Query(ctx, q, args...)
	if err != nil {
		return ins, 0, err
	}
	in := ReplyIn{Queue: queue}
	var r correlator.Reply
	var att *int32
	var reply, hdr []byte
	var retryAt *time.Time
	_, err = pgx.ForEachRow(rows, []any{&in.earlyID, &in.earlyQueue, &r.JobType, &r.JobKey, &r.JobID, &att, &r.Success, &r.Retryable,
		&r.Error, &reply, &hdr, &in.Kind, &in.Source.Topic, &in.Source.Partition, &in.Source.Offset,
		&in.Source.Key, &in.Source.Value, &in.Source.Received, &in.expires, &retryAt}, func() error {
		rc := r
		rc.RetryAfter = correlator.RetryAfter{}
		if retryAt != nil {
			rc.RetryAfter.At = *retryAt
		}
		if att != nil {
			a := int(*att)
			rc.Attempt = &a
		}
		rc.Result = append(json.RawMessage(nil), reply...)
		in.Source.Headers = decodeHeaders(hdr)
		in.Reply = &rc
		ins = append(ins, in)
		last = in.earlyID
		return nil
	})
	return ins, last, err
}

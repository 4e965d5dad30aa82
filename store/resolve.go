package store

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// Resolve ends one running attempt: the job moves as Res (one of the
// domain's named ends) says, and the attempt row records its outcome.
type Resolve struct {
	Queue   string
	JobID   int64
	Attempt int
	Res     correlator.Resolution
	Result  json.RawMessage // stored in hipq_job.result on success
	Reply   json.RawMessage // the reply, when one came
	// ResultIsReply: the result is the reply itself (Result unused), sent
	// to PostgreSQL once and parsed into jsonb once for both columns.
	ResultIsReply bool
	// Sent: the request reached the service (an HTTP answer of any
	// status): sent_at is set if it is not yet.
	Sent bool
	// Claim, when set, limits the resolution to that claim of the attempt
	// (see AttemptRef.Claim): the send's own outcomes name it, replies
	// do not.
	Claim time.Time
	// NeverLeft: the request surely never reached the service (refused):
	// the rate units of its claim give it back. It needs Claim.
	NeverLeft bool
}

// Ref names the attempt r ends.
func (r Resolve) Ref() AttemptRef {
	return AttemptRef{Queue: r.Queue, JobID: r.JobID, Attempt: r.Attempt, Claim: r.Claim}
}

// JobResolveMany applies resolutions in one statement, each guarded by
// state running and its attempt (and its claim, when it names one), and notifies hipq_job_ready (a throttle
// slot is free). It returns the refs that took effect; the
// others were moved by someone else first.
func (s *Store) JobResolveMany(ctx context.Context, rs []Resolve) ([]AttemptRef, error) {
	var done []resolved
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		refs := make([]AttemptRef, len(rs))
		for i, r := range rs {
			refs[i] = r.Ref()
		}
		if err := lockJobs(ctx, tx, refs); err != nil {
			return err
		}
		var err error
		done, err = jobResolveMany(ctx, tx, s.events, rs)
		return err
	})
	return refsOf(done), err
}

// resolved is a resolution that took effect, with how long its attempt ran.
type resolved struct {
	AttemptRef
	correlator.RoundTrip
}

func refsOf(rs []resolved) []AttemptRef {
	if rs == nil {
		return nil
	}
	out := make([]AttemptRef, len(rs))
	for i, r := range rs {
		out[i] = r.AttemptRef
	}
	return out
}

// resolveManySQL is jobResolveMany's statement. Its caller has locked the
// jobs in an earlier statement of the transaction (in (queue, id) order, as
// every path that writes jobs or attempts does: see DeliveryRecord).
var resolveManySQL = `
		WITH u AS (
		  SELECT * FROM unnest(@id::bigint[], @attempt::int[], @state::text[], @outcome::text[], @error::text[],
		                       @next_run::timestamptz[], @result::jsonb[], @att_outcome::text[], @att_error::text[], @reply::jsonb[],
		                       @sent::bool[], @result_is_reply::bool[], @claim::timestamptz[])
		    AS u(id, att, state, outcome, error, next_run, result, att_outcome, att_error, reply, sent, result_is_reply, claim)
		), t AS (
		  -- Each job found by its key, then updated by its tuple id: never
		  -- a join that reads every running job, which statistics taken
		  -- when few ran make look cheap (O(running) per batch). The caller
		  -- holds the rows' locks, taken by an earlier statement, so this
		  -- statement sees the versions locked and no other can replace
		  -- them: the guard (state running, the attempt) reads them.
		  SELECT u.*, b.tid, b.state AS cur_state, b.attempt AS cur_att, b.started_at AS cur_claim
		  FROM u CROSS JOIN LATERAL (
		    SELECT j.ctid AS tid, j.state, j.attempt, j.started_at FROM hipq_job j WHERE j.queue = @queue AND j.id = u.id OFFSET 0) b
		), done AS (
		  UPDATE hipq_job j
		  SET state = t.state, outcome = t.outcome, error = t.error,
		      scheduled_run_time = coalesce(t.next_run, j.scheduled_run_time),
		      result = coalesce(t.result, CASE WHEN t.result_is_reply THEN t.reply END, j.result), update_time = now()
		  FROM t
		  WHERE j.queue = @queue AND j.ctid = t.tid AND t.cur_state = 'running' AND t.cur_att = t.att
		    AND (t.claim IS NULL OR t.cur_claim = t.claim)
		  RETURNING j.id, j.queue, j.job_type, j.attempt, j.started_at, t.att_outcome, t.att_error, t.reply, t.sent/*event columns*/
		), /*events*/notify AS (
		  -- A job left running: a throttle slot is free, so dispatchers
		  -- may claim now rather than at their next poll.
		  SELECT pg_notify('` + channelJobReady + `', q) FROM (SELECT DISTINCT queue AS q FROM done) d
		), att AS (
		  -- done carries u's values: joining two CTEs (no statistics) could
		  -- plan as a nested loop, quadratic in the batch.
		  UPDATE hipq_attempt a
		  SET outcome = done.att_outcome, error = done.att_error, reply = done.reply,
		      replied_at = CASE WHEN done.reply IS NOT NULL THEN now() END,
		      sent_at = CASE WHEN done.reply IS NOT NULL OR done.sent THEN coalesce(a.sent_at, now()) ELSE a.sent_at END
		  FROM done
		  WHERE a.queue = @queue AND a.job_id = done.id AND a.attempt = done.attempt
		)
		SELECT id, attempt, job_type, extract(epoch FROM now() - started_at)::float8 FROM done
		WHERE (SELECT count(*) FROM notify) >= 0`

// resolveManyEventsSQL is resolveManySQL that writes the jobs' outcome
// events too (eventsCTE), with the routes in @ev_type, @ev_topic and
// @ev_attempts.
// The queue is named first (so it is $1): the events' CTE reads the moved
// rows through lateral references, which EXPLAIN numbers $1, $2, … too,
// and the queue's number must not read like one of them
// (TestEveryWriteNamesItsQueue).
var resolveManyEventsSQL = queueFirst(withEvents(resolveManySQL, "@ev_type", "@ev_topic", "@ev_attempts"))

// queueFirst makes of resolveManySQL's form with events one that names
// the queue first (see resolveManyEventsSQL).
func queueFirst(stmt string) string {
	return mustReplace(stmt, "WITH u AS (\n\t\t  SELECT * FROM unnest(", "WITH u AS (\n\t\t  SELECT u.* FROM (SELECT @queue::text) AS q(queue), unnest(")
}

// resolveForms are resolveManySQL's texts. On Citus, which runs a statement's CTEs one after the other and
// reaches a row of a distributed table by its key, never by its tuple id:
// the jobs are updated by (queue, id), still locked by the caller. The
// notice goes in a statement of its own (notifyCitus): Citus would send
// the CTE's to the worker, where nobody listens and which commits in two
// phases, refusing a NOTIFY.
// On one PostgreSQL the events' form is resolveFinalOnJobSQL (the Citus
// forms are made from resolveManyEventsSQL: there every event is a row).
var resolveForms = func() statementForms {
	f := formsOf(resolveManySQL, resolveManyEventsSQL, resolveForCitus)
	f.events = resolveFinalOnJobSQL
	return f
}()

// resolveFinalOnJobSQL is resolveManyEventsSQL where a job of a routed
// type that ends gets no row of hipq_event for its final event on its
// type's topic: the update sets its event_topic and event_id (from
// hipq_event's sequence) and the relay reads the job itself (EventReadFrom),
// which is never updated again. The id is handed out by the update, after
// the transaction has its own id, as EventCursor requires: the caller's
// lock (an earlier statement) gave it one, and xid asks for it besides,
// before the first row is read. The statement notifies the relay of those
// topics, as hipq_event's trigger does of its rows'.
var resolveFinalOnJobSQL = replaceEach(
	queueFirst(withEventsCTE(resolveManySQL, eventsCTE("done", "@ev_type", "@ev_topic", "@ev_attempts", true))),
	"SELECT j.ctid AS tid, j.state, j.attempt, j.started_at FROM hipq_job j",
	"SELECT j.ctid AS tid, j.state, j.attempt, j.started_at, j.job_type AS cur_type FROM hipq_job j",
	"), t AS (", "), xid AS MATERIALIZED (SELECT pg_current_xact_id() AS xid\n\t\t), t AS (",
	"FROM u CROSS JOIN LATERAL (", "FROM xid, u CROSS JOIN LATERAL (",
	"SELECT u.*, b.tid, b.state AS cur_state, b.attempt AS cur_att, b.started_at AS cur_claim",
	`SELECT u.*, b.tid, b.state AS cur_state, b.attempt AS cur_att, b.started_at AS cur_claim,
		         CASE WHEN u.state = 'final' THEN (SELECT r.topic FROM unnest(@ev_type::text[], @ev_topic::text[]) AS r(job_type, topic)
		                                           WHERE r.job_type = b.cur_type LIMIT 1) END AS ev_topic`,
	"update_time = now()\n\t\t  FROM t",
	"update_time = now(),\n\t\t      event_topic = t.ev_topic, event_id = CASE WHEN t.ev_topic IS NOT NULL THEN nextval('hipq_event_id_seq') END\n\t\t  FROM t",
	"t.reply, t.sent, j.job_key", "t.reply, t.sent, j.event_topic, j.job_key",
	"), att AS (",
	`), evnotify AS (
		  SELECT pg_notify('`+channelEvent+`', CASE WHEN octet_length(x.topics) < 7000 THEN x.topics ELSE '' END)
		  FROM (SELECT string_agg(DISTINCT event_topic, ',' ORDER BY event_topic) AS topics FROM done WHERE event_topic IS NOT NULL) x
		  WHERE x.topics IS NOT NULL
		), att AS (`,
	"WHERE (SELECT count(*) FROM notify) >= 0", "WHERE (SELECT count(*) FROM notify) + (SELECT count(*) FROM evnotify) >= 0")

func resolveForCitus(stmt string) string {
	stmt = mustReplace(stmt, "SELECT j.ctid AS tid, j.state", "SELECT j.id AS tid, j.state")
	stmt = mustReplace(stmt, "j.ctid = t.tid", "j.id = t.tid")
	// (Citus evaluates now() once, on the coordinator, but not under a
	// CASE or a coalesce: the attempts' times come from the jobs' update.)
	stmt = mustReplace(stmt, "RETURNING j.id, j.queue,", "RETURNING j.update_time AS at, j.id, j.queue,")
	stmt = mustReplace(stmt, "replied_at = CASE WHEN done.reply IS NOT NULL THEN now() END", "replied_at = CASE WHEN done.reply IS NOT NULL THEN done.at END")
	stmt = mustReplace(stmt, "coalesce(a.sent_at, now())", "coalesce(a.sent_at, done.at)")
	return mustReplace(stmt, "SELECT pg_notify('"+channelJobReady+"', q) FROM (SELECT DISTINCT queue AS q FROM done) d", "SELECT 1")
}

// lockJobsSQL locks the jobs of queue $1 whose ids are $2, in id order.
const lockJobsSQL = `SELECT 1 FROM hipq_job WHERE queue = $1 AND id = ANY($2) ORDER BY id FOR UPDATE`

// lockJobs locks the jobs refs name in (queue, id) order, the order of
// every path that waits for jobs' locks, so two never wait on each other
// (but for a reply to a job whose type moved to another queue while it ran:
// see lockTargets).
func lockJobs(ctx context.Context, tx execer, refs []AttemptRef) error {
	err := perQueue(refs, refQueue, func(q string, refs []AttemptRef) error {
		ids, _ := refArrays(refs)
		_, err := tx.Exec(ctx, lockJobsSQL, q, ids)
		return err
	})
	if err != nil {
		return fmt.Errorf("lock jobs: %w", err)
	}
	return nil
}

// jobResolveMany applies resolutions in tx, which holds the jobs' locks
// (lockJobs, or the reply and sweep paths' own locking reads), and writes
// the outcome events ev asks for in the same statements.
func jobResolveMany(ctx context.Context, tx pgx.Tx, ev *Events, rs []Resolve) ([]resolved, error) {
	var out []resolved
	err := perQueue(rs, func(r Resolve) string { return r.Queue }, func(q string, rs []Resolve) error {
		done, err := resolveQueue(ctx, tx, ev, q, rs)
		out = append(out, done...)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("resolve attempts: %w", err)
	}
	return out, nil
}

// resolveQueue is jobResolveMany's statement for the resolutions of one queue.
func resolveQueue(ctx context.Context, tx pgx.Tx, ev *Events, queue string, rs []Resolve) ([]resolved, error) {
	n := len(rs)
	ids, atts := make([]int64, n), make([]int32, n)
	states, errs, attOutcomes := make([]string, n), make([]string, n), make([]string, n)
	outcomes, results, attErrs, replies := make([]*string, n), make([]*string, n), make([]*string, n), make([]*string, n)
	next := make([]*time.Time, n)
	sent, resultIsReply := make([]bool, n), make([]bool, n)
	for i, r := range rs {
		ids[i], atts[i], sent[i] = r.JobID, int32(r.Attempt), r.Sent
		states[i], errs[i], attOutcomes[i] = string(r.Res.State), safeText(r.Res.Error), string(r.Res.Attempt)
		outcomes[i] = nullable(string(r.Res.Outcome))
		if !r.Res.NextRun.IsZero() {
			t := r.Res.NextRun
			next[i] = &t
		}
		if r.Res.Outcome == correlator.OutcomeSucceeded {
			switch {
			case r.ResultIsReply && r.Reply != nil:
				resultIsReply[i] = true
			case r.Result != nil:
				results[i] = nullable(string(r.Result))
			}
		}
		if r.Res.Attempt != correlator.AttemptSucceeded {
			attErrs[i] = nullable(safeText(r.Res.AttemptError))
		}
		if r.Reply != nil {
			replies[i] = nullable(string(r.Reply))
		}
	}
	args := pgx.StrictNamedArgs{
		"id": ids, "attempt": atts, "state": states, "outcome": outcomes, "error": errs, "next_run": next, "result": results,
		"att_outcome": attOutcomes, "att_error": attErrs, "reply": replies, "sent": sent, "result_is_reply": resultIsReply,
		"claim": claimsOf(rs, func(r Resolve) time.Time { return r.Claim }), "queue": queue,
	}
	if ev.On() {
		args["ev_type"], args["ev_topic"], args["ev_attempts"] = ev.args()
	}
	dist := distributedTx(tx)
	q := resolveForms.pick(ev.On(), dist)
	if ev.On() && !dist && !ev.finalOnJob(ctx, tx) {
		q = resolveManyEventsSQL
	}
	rows, err := tx.Query(ctx, q, args)
	if err != nil {
		return nil, err
	}
	var out []resolved
	r := resolved{AttemptRef: AttemptRef{Queue: queue}}
	var secs *float64
	if _, err := pgx.ForEachRow(rows, []any{&r.JobID, &r.Attempt, &r.JobType, &secs}, func() error {
		r.Elapsed = 0
		if secs != nil {
			r.Elapsed = time.Duration(*secs * float64(time.Second))
		}
		out = append(out, r)
		return nil
	}); err != nil {
		return nil, err
	}
	if dist && len(out) > 0 {
		if err := notifyCitus(ctx, tx, ev.On(), queue); err != nil {
			return nil, err
		}
	}
	return out, nil
}

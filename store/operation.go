package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/hipq/hipq/correlator"
)

// A bulk operation acts on every job (or dead letter) a filter matches: it
// walks the table by id, at most MaxOperationBatch rows per transaction,
// each row guarded as the single action guards it, and keeps its cursor
// and counts in hipq_operation in the same transaction as the batch's
// effects. So an operation cut short goes on from its cursor, acts on no
// row twice, and never holds the locks of more than one batch.

// OperationKind says what a bulk operation does.
type OperationKind string

const (
	// OperationCancel moves non-final jobs to final / cancelled.
	OperationCancel OperationKind = "jobs.cancel"
	// OperationReplay makes a new job of each key whose newest job is
	// final, as a single replay does.
	OperationReplay OperationKind = "jobs.replay"
	// OperationRunNow moves waiting jobs' scheduled_run_time to now.
	OperationRunNow OperationKind = "jobs.run_now"
	// OperationDeadLetterReplay sends dead letters again through the path
	// they came from, as a single dead-letter replay does.
	OperationDeadLetterReplay OperationKind = "dead_letters.replay"
)

// OperationState is where an operation is.
type OperationState string

const (
	OperationRunning OperationState = "running"
	OperationDone    OperationState = "done"
	OperationStopped OperationState = "stopped"
)

// MaxOperationBatch is the most rows one transaction of an operation
// walks: its locks are held for as short a time as a hot-path batch's.
const MaxOperationBatch = 1000

// JobFilter selects the jobs of a bulk operation; empty fields match all.
// Times bound created_at and update_time, "before" exclusive and "after"
// inclusive.
type JobFilter struct {
	Queue         string             `json:"queue,omitempty"`
	JobType       string             `json:"job_type,omitempty"`
	State         correlator.State   `json:"state,omitempty"`
	Outcome       correlator.Outcome `json:"outcome,omitempty"`
	KeyPrefix     string             `json:"key_prefix,omitempty"`
	CreatedBefore *time.Time         `json:"created_before,omitempty"`
	CreatedAfter  *time.Time         `json:"created_after,omitempty"`
	UpdatedBefore *time.Time         `json:"updated_before,omitempty"`
	UpdatedAfter  *time.Time         `json:"updated_after,omitempty"`
}

// DeadLetterFilter selects the dead letters of a bulk replay; empty fields
// match all. ReasonPrefix is matched as plain characters.
type DeadLetterFilter struct {
	Source         string     `json:"source,omitempty"`
	ReasonPrefix   string     `json:"reason_prefix,omitempty"`
	ReceivedBefore *time.Time `json:"received_before,omitempty"`
	ReceivedAfter  *time.Time `json:"received_after,omitempty"`
}

// Operation is one row of hipq_operation. Matched counts the rows the walk
// found in the filter so far; each is Done (acted on) or Skipped (it had
// moved on when its turn came, or the action does not apply to it).
type Operation struct {
	ID          int64
	Kind        OperationKind
	Jobs        *JobFilter        // for the jobs.* kinds
	DeadLetters *DeadLetterFilter // for dead_letters.replay
	Reason      string
	TokenName   string
	State       OperationState
	Matched     int64
	Done        int64
	Skipped     int64
	Cursor      int64 // the highest id walked
	Until       int64 // the highest id of the table when it was asked
	CreatedAt   time.Time
	UpdatedAt   time.Time
}

// ForJobs reports whether the operation acts on jobs (else dead letters).
func (k OperationKind) ForJobs() bool { return k != OperationDeadLetterReplay }

// ErrOperationLost is returned by OperationStep when the operation is no
// longer this worker's to work: stopped, ended, or taken by another
// instance after this one's lease passed.
var ErrOperationLost = errors.New("the operation is no longer this worker's: stopped, ended or taken over")

// ErrOperationEnded is returned when stopping an operation that is done.
var ErrOperationEnded = errors.New("the operation has ended")

const operationColumns = `id, kind, filter, reason, token_name, state, matched, done, skipped, cursor_id, until_id, created_at, updated_at`

func scanOperation(row pgx.Row) (Operation, error) {
	var op Operation
	var filter []byte
	err := row.Scan(&op.ID, &op.Kind, &filter, &op.Reason, &op.TokenName, &op.State, &op.Matched, &op.Done, &op.Skipped,
		&op.Cursor, &op.Until, &op.CreatedAt, &op.UpdatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return op, correlator.ErrNotFound
	}
	if err != nil {
		return op, err
	}
	if op.Kind.ForJobs() {
		op.Jobs = &JobFilter{}
		err = json.Unmarshal(filter, op.Jobs)
	} else {
		op.DeadLetters = &DeadLetterFilter{}
		err = json.Unmarshal(filter, op.DeadLetters)
	}
	if err != nil {
		return op, fmt.Errorf("operation %d: its filter: %w", op.ID, err)
	}
	return op, nil
}

// DatabaseNow is PostgreSQL's clock, the one created_at and received_at
// are written with.
func (s *Store) DatabaseNow(ctx context.Context) (time.Time, error) {
	var now time.Time
	if err := s.pool.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return now, fmt.Errorf("read the database clock: %w", err)
	}
	return now, nil
}

// where is a filter's condition on hipq_job (aliased j), the kind's own
// condition first: what the action can apply to at all (none for kind "").
func (f JobFilter) where(kind OperationKind, args pgx.NamedArgs) string {
	var w []string
	switch kind {
	case OperationCancel:
		w = append(w, "j.state <> 'final'")
	case OperationReplay:
		w = append(w, "j.state = 'final'")
	case OperationRunNow:
		w = append(w, "j.state IN ('initial', 'retry')")
	}
	eq := func(col, name string, v any, set bool) {
		if set {
			args[name] = v
			w = append(w, fmt.Sprintf("j.%s = @%s", col, name))
		}
	}
	eq("queue", "f_queue", f.Queue, f.Queue != "")
	eq("job_type", "f_job_type", f.JobType, f.JobType != "")
	eq("state", "f_state", string(f.State), f.State != "")
	eq("outcome", "f_outcome", string(f.Outcome), f.Outcome != "")
	if f.KeyPrefix != "" {
		args["f_key_prefix"] = f.KeyPrefix
		w = append(w, "starts_with(j.job_key, @f_key_prefix)")
	}
	bound := func(col, name string, t *time.Time, op string) {
		if t != nil {
			args[name] = *t
			w = append(w, fmt.Sprintf("j.%s %s @%s", col, op, name))
		}
	}
	bound("created_at", "f_created_before", f.CreatedBefore, "<")
	bound("created_at", "f_created_after", f.CreatedAfter, ">=")
	bound("update_time", "f_updated_before", f.UpdatedBefore, "<")
	bound("update_time", "f_updated_after", f.UpdatedAfter, ">=")
	return strings.Join(w, " AND ")
}

// where is a filter's condition on hipq_dead_letter (aliased d): only
// those not replayed yet, as a replay of one already replayed is refused.
func (f DeadLetterFilter) where(args pgx.NamedArgs) string {
	w := []string{"d.replayed_at IS NULL"}
	if f.Source != "" {
		args["f_source"] = f.Source
		w = append(w, "d.source = @f_source")
	}
	if f.ReasonPrefix != "" {
		args["f_reason_prefix"] = f.ReasonPrefix
		w = append(w, "starts_with(d.reason, @f_reason_prefix)")
	}
	if f.ReceivedBefore != nil {
		args["f_received_before"] = *f.ReceivedBefore
		w = append(w, "d.received_at < @f_received_before")
	}
	if f.ReceivedAfter != nil {
		args["f_received_after"] = *f.ReceivedAfter
		w = append(w, "d.received_at >= @f_received_after")
	}
	return strings.Join(w, " AND ")
}

// OperationCount is what a dry run answers: how many rows the operation
// would walk now.
func (s *Store) OperationCount(ctx context.Context, op Operation) (int64, error) {
	return s.OperationCountUpTo(ctx, op, 0)
}

// OperationCountUpTo is OperationCount counting no further than limit
// rows (0: no limit), so a page can show a count cheaply. An operation of
// kind "" with a job filter counts the jobs of the filter alone, in any
// state.
func (s *Store) OperationCountUpTo(ctx context.Context, op Operation, limit int64) (int64, error) {
	args := pgx.NamedArgs{}
	q := `SELECT 1 FROM hipq_job j WHERE `
	if op.Kind.ForJobs() {
		q += op.Jobs.where(op.Kind, args)
	} else {
		q = `SELECT 1 FROM hipq_dead_letter d WHERE ` + op.DeadLetters.where(args)
	}
	if limit > 0 {
		args["limit"] = limit
		q += ` LIMIT @limit`
	}
	var n int64
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM (`+q+`) x`, args).Scan(&n); err != nil {
		return 0, fmt.Errorf("count %s: %w", op.Kind, err)
	}
	return n, nil
}

// OperationCreate stores a new running operation held by owner for lease,
// bounded by the highest id of its table now, and returns it.
func (s *Store) OperationCreate(ctx context.Context, op Operation, owner string, lease time.Duration) (Operation, error) {
	var filter any = op.Jobs
	table := "hipq_job"
	if !op.Kind.ForJobs() {
		filter, table = op.DeadLetters, "hipq_dead_letter"
	}
	b, err := json.Marshal(filter)
	if err != nil {
		return op, fmt.Errorf("create operation: %w", err)
	}
	// (read apart from the insert: a statement that writes reads no job
	// of every queue)
	var until int64
	if err := s.pool.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM `+table).Scan(&until); err != nil {
		return op, fmt.Errorf("create operation: %w", err)
	}
	out, err := scanOperation(s.pool.QueryRow(ctx, `
		INSERT INTO hipq_operation (kind, filter, reason, token_name, until_id, owner, lease_until)
		VALUES (@kind, @filter, @reason, @token_name, @until, @owner, now() + @lease)
		RETURNING `+operationColumns,
		pgx.StrictNamedArgs{"kind": string(op.Kind), "filter": string(b), "reason": safeText(op.Reason), "token_name": op.TokenName,
			"until": until, "owner": owner, "lease": lease}))
	if err != nil {
		return out, fmt.Errorf("create operation: %w", err)
	}
	return out, nil
}

// OperationGet returns one operation, or correlator.ErrNotFound.
func (s *Store) OperationGet(ctx context.Context, id int64) (Operation, error) {
	op, err := scanOperation(s.pool.QueryRow(ctx, `SELECT `+operationColumns+` FROM hipq_operation WHERE id = $1`, id))
	if err != nil && !errors.Is(err, correlator.ErrNotFound) {
		return op, fmt.Errorf("get operation %d: %w", id, err)
	}
	return op, err
}

// OperationStop stops a running operation: no batch runs after this
// returns (one under way commits first, its row locked until then). It
// returns the operation and whether this call stopped it; one stopped
// already is returned as it is, one done is ErrOperationEnded.
func (s *Store) OperationStop(ctx context.Context, id int64) (Operation, bool, error) {
	op, err := scanOperation(s.pool.QueryRow(ctx, `UPDATE hipq_operation SET state = 'stopped', owner = NULL, lease_until = NULL,
		updated_at = now() WHERE id = $1 AND state = 'running' RETURNING `+operationColumns, id))
	if err == nil {
		return op, true, nil
	}
	if !errors.Is(err, correlator.ErrNotFound) {
		return op, false, fmt.Errorf("stop operation %d: %w", id, err)
	}
	op, err = s.OperationGet(ctx, id)
	if err == nil && op.State == OperationDone {
		err = ErrOperationEnded
	}
	return op, false, err
}

// OperationsAbandoned lists the running operations nobody holds: their
// worker let go, or its lease passed (the instance died).
func (s *Store) OperationsAbandoned(ctx context.Context) ([]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT id FROM hipq_operation
		WHERE state = 'running' AND (owner IS NULL OR lease_until < now()) ORDER BY id`)
	if err != nil {
		return nil, fmt.Errorf("list abandoned operations: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("list abandoned operations: %w", err)
	}
	return ids, nil
}

// OperationTake makes owner the worker of a running operation nobody
// holds (or owner holds already), for lease; false when another holds it
// or it is not running.
func (s *Store) OperationTake(ctx context.Context, id int64, owner string, lease time.Duration) (bool, error) {
	tag, err := s.pool.Exec(ctx, `UPDATE hipq_operation SET owner = @owner, lease_until = now() + @lease
		WHERE id = @id AND state = 'running' AND (owner IS NULL OR lease_until < now() OR owner = @owner)`,
		pgx.StrictNamedArgs{"id": id, "owner": owner, "lease": lease})
	if err != nil {
		return false, fmt.Errorf("take operation %d: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// OperationRelease lets go of an operation owner holds, for another
// instance (or this one, later) to take at once.
func (s *Store) OperationRelease(ctx context.Context, id int64, owner string) error {
	_, err := s.pool.Exec(ctx, `UPDATE hipq_operation SET owner = NULL, lease_until = NULL
		WHERE id = $1 AND owner = $2 AND state = 'running'`, id, owner)
	if err != nil {
		return fmt.Errorf("release operation %d: %w", id, err)
	}
	return nil
}

// OperationWork is what OperationStep needs besides the operation.
type OperationWork struct {
	// Owner works the operation; Lease is how long each step keeps it
	// this owner's.
	Owner string
	Lease time.Duration
	// Batch is the most rows a step walks; 0 or more than
	// MaxOperationBatch is MaxOperationBatch.
	Batch int
	// Types are the job types as configured now: a replay makes its jobs
	// from them (a type no longer configured is skipped), and replayed
	// replies are resolved by them.
	Types correlator.Types
	// EarlyTTL is how long a replayed reply that came early is kept.
	EarlyTTL time.Duration
	// DecodeDeadLetter reads a dead letter again with today's config: an
	// intake or outbox record into a job, a reply or callback into a
	// reply. An error means it is refused again.
	DecodeDeadLetter func(DeadLetter) (*correlator.Job, *ReplyIn, error)
}

// step is what one batch found: rows walked (matched), acted on (done),
// and the highest id walked.
type step struct {
	matched, done int
	last          int64
}

// OperationStep works one batch of the operation, in one transaction: it
// walks the next rows after the cursor, acts on each as its kind says,
// guarded as the single action is, and moves the cursor, the counts and
// the lease with them. The operation is done when a batch walks fewer
// rows than it may. ErrOperationLost when it is not owner's to work.
func (s *Store) OperationStep(ctx context.Context, id int64, w OperationWork) (Operation, error) {
	if w.Batch <= 0 || w.Batch > MaxOperationBatch {
		w.Batch = MaxOperationBatch
	}
	var out Operation
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		op, err := scanOperation(tx.QueryRow(ctx, `SELECT `+operationColumns+` FROM hipq_operation
			WHERE id = $1 AND owner = $2 AND state = 'running' FOR UPDATE`, id, w.Owner))
		if errors.Is(err, correlator.ErrNotFound) {
			return ErrOperationLost
		}
		if err != nil {
			return err
		}
		var st step
		switch op.Kind {
		case OperationCancel, OperationRunNow:
			st, err = jobsMoveBatch(ctx, tx, s.events, op, w.Batch)
		case OperationReplay:
			st, err = jobsReplayBatch(ctx, tx, op, w)
		case OperationDeadLetterReplay:
			st, err = deadLettersReplayBatch(ctx, tx, s.events, op, w)
		default:
			err = fmt.Errorf("unknown kind %q", op.Kind)
		}
		if err != nil {
			return err
		}
		end := st.matched < w.Batch
		out, err = scanOperation(tx.QueryRow(ctx, `UPDATE hipq_operation SET
			cursor_id = greatest(cursor_id, @last), matched = matched + @matched, done = done + @done, skipped = skipped + @skipped,
			state = CASE WHEN @end THEN 'done' ELSE state END,
			owner = CASE WHEN @end THEN NULL ELSE owner END,
			lease_until = now() + CASE WHEN @end THEN NULL ELSE @lease::interval END, -- (now() outside the CASE: Citus evaluates it there only)
			updated_at = now()
			WHERE id = @id RETURNING `+operationColumns,
			pgx.StrictNamedArgs{"id": id, "last": st.last, "matched": st.matched, "done": st.done, "skipped": st.matched - st.done,
				"end": end, "lease": w.Lease}))
		return err
	})
	if err != nil && !errors.Is(err, ErrOperationLost) {
		return out, fmt.Errorf("operation %d: %w", id, err)
	}
	return out, err
}

// walked is a job a batch walked, as it read it.
type walked struct {
	id      int64
	queue   string
	state   string
	attempt int32
}

// jobsWalk reads the next batch of jobs of a cancel or run-now after the
// cursor: reading only (across queues); the writes name each queue.
func jobsWalk(ctx context.Context, tx pgx.Tx, op Operation, n int) ([]walked, error) {
	args := pgx.NamedArgs{"cursor": op.Cursor, "until": op.Until, "n": n}
	rows, err := tx.Query(ctx, `SELECT j.id, j.queue, j.state, j.attempt FROM hipq_job j
		WHERE j.id > @cursor AND j.id <= @until AND `+op.Jobs.where(op.Kind, args)+` ORDER BY j.id LIMIT @n`, args)
	if err != nil {
		return nil, fmt.Errorf("walk jobs: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (walked, error) {
		var w walked
		err := r.Scan(&w.id, &w.queue, &w.state, &w.attempt)
		return w, err
	})
}

// jobsMoveBatch cancels, or makes due now, the next batch of jobs. Each
// job is written only if it is still in the state and attempt the walk
// read (a claim, a reply or the sweeper may have moved it since): one
// that moved is skipped. A run-now skips a job due already too.
func jobsMoveBatch(ctx context.Context, tx pgx.Tx, ev *Events, op Operation, n int) (step, error) {
	ws, err := jobsWalk(ctx, tx, op, n)
	if err != nil || len(ws) == 0 {
		return step{}, err
	}
	st := step{matched: len(ws), last: ws[len(ws)-1].id}
	var woken []string
	err = perQueue(ws, func(w walked) string { return w.queue }, func(q string, g []walked) error {
		ids, states, attempts := make([]int64, len(g)), make([]string, len(g)), make([]int32, len(g))
		for i, w := range g {
			ids[i], states[i], attempts[i] = w.id, w.state, w.attempt
		}
		args := pgx.StrictNamedArgs{"queue": q, "id": ids, "state": states, "attempt": attempts}
		// The rows are locked in id order first, as every path that moves
		// several jobs locks them (resolves, deliveries), so no two of
		// them wait for each other in a cycle.
		if _, err := tx.Exec(ctx, lockJobsSQL, q, ids); err != nil {
			return fmt.Errorf("%s in queue %q: lock: %w", op.Kind, q, err)
		}
		var moved int
		var err error
		if op.Kind == OperationCancel {
			moved, err = jobsCancelGuarded(ctx, tx, ev, args)
		} else {
			var tag pgconn.CommandTag
			tag, err = tx.Exec(ctx, `UPDATE hipq_job j SET scheduled_run_time = now()
				FROM unnest(@id::bigint[], @state::text[], @attempt::int[]) u(id, state, attempt)
				WHERE j.queue = @queue AND j.id = u.id AND j.state = u.state AND j.attempt = u.attempt AND j.scheduled_run_time > now()`, args)
			if err == nil {
				moved = int(tag.RowsAffected())
			}
		}
		if err != nil {
			return fmt.Errorf("%s in queue %q: %w", op.Kind, q, err)
		}
		st.done += moved
		if moved > 0 {
			woken = append(woken, q)
		}
		return nil
	})
	if err != nil {
		return st, err
	}
	// Jobs ended (throttle slots free) or became due: dispatchers look now.
	if len(woken) > 0 && distributedTx(tx) { // (and the relay, which no trigger wakes there)
		if err := notifyCitus(ctx, tx, ev.On() && op.Kind == OperationCancel, woken...); err != nil {
			return st, err
		}
	} else if len(woken) > 0 {
		if _, err := tx.Exec(ctx, `SELECT pg_notify('`+channelJobReady+`', q) FROM unnest($1::text[]) q`, woken); err != nil {
			return st, err
		}
	}
	return st, nil
}

// jobsCancelGuarded cancels the jobs of one queue still in the state and
// attempt given, and marks their attempt in flight cancelled (its reply,
// should one come, is then a duplicate), as JobCancel does: the jobs
// first (with their outcome events, in the same statement), then their
// attempts.
func jobsCancelGuarded(ctx context.Context, tx pgx.Tx, ev *Events, args pgx.StrictNamedArgs) (int, error) {
	args["error"] = correlator.ErrorCancelled
	stmt := bulkCancelSQL
	if ev.On() {
		stmt = bulkCancelEventsSQL
		args["ev_types"], args["ev_topics"], args["ev_attempts"] = ev.args()
	}
	rows, err := tx.Query(ctx, stmt, args)
	if err != nil {
		return 0, err
	}
	var ids []int64
	var attempts []int32
	var id int64
	var attempt int32
	if _, err := pgx.ForEachRow(rows, []any{&id, &attempt}, func() error {
		ids, attempts = append(ids, id), append(attempts, attempt)
		return nil
	}); err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		return 0, nil
	}
	_, err = tx.Exec(ctx, `UPDATE hipq_attempt a SET outcome = 'cancelled', error = @error
		FROM unnest(@id::bigint[], @attempt::int[]) u(id, attempt)
		WHERE a.queue = @queue AND a.job_id = u.id AND a.attempt = u.attempt AND a.outcome IS NULL`,
		pgx.StrictNamedArgs{"queue": args["queue"], "id": ids, "attempt": attempts, "error": correlator.ErrorCancelled})
	return len(ids), err
}

// bulkCancelSQL ends the jobs of queue @queue whose ids, states and
// attempts are @id, @state and @attempt (unnested together) final /
// cancelled, each only from the state and attempt given.
const bulkCancelSQL = `WITH done AS (
		  UPDATE hipq_job j SET state = 'final', outcome = 'cancelled', error = @error, update_time = now()
		  FROM unnest(@id::bigint[], @state::text[], @attempt::int[]) u(id, state, attempt)
		  WHERE j.queue = @queue AND j.id = u.id AND j.state = u.state AND j.attempt = u.attempt
		  RETURNING j.id, j.queue, j.job_type, j.attempt /*event columns*/
		), /*events*/cancelled AS (SELECT 1)
		SELECT id, attempt FROM done`

// bulkCancelEventsSQL is bulkCancelSQL that writes the jobs' outcome
// events too, with the routes in @ev_types, @ev_topics and @ev_attempts.
var bulkCancelEventsSQL = withEvents(bulkCancelSQL, "@ev_types", "@ev_topics", "@ev_attempts")

// jobsReplayBatch replays the next batch of final jobs: each that is the
// newest job of its key, of a type configured now, becomes a new job as
// JobReplay makes it. A key with a newer job (a replay done already, or a
// job enqueued since) is skipped, and so is one whose new job meets a
// non-final job the insert finds in its way.
func jobsReplayBatch(ctx context.Context, tx pgx.Tx, op Operation, w OperationWork) (step, error) {
	args := pgx.NamedArgs{"cursor": op.Cursor, "until": op.Until, "n": w.Batch}
	// (newest: no non-final job of the key, and no final one after it)
	q := `SELECT ` + jobColumns + `, newest FROM (
		SELECT j.*,
		  NOT EXISTS (SELECT 1 FROM hipq_job n WHERE n.job_type = j.job_type AND n.job_key = j.job_key AND n.state <> 'final')
		  AND NOT EXISTS (SELECT 1 FROM hipq_job n WHERE n.job_type = j.job_type AND n.job_key = j.job_key AND n.state = 'final'
		                  AND n.id > j.id) AS newest
		FROM hipq_job j WHERE j.id > @cursor AND j.id <= @until AND ` + op.Jobs.where(op.Kind, args) + ` ORDER BY j.id LIMIT @n) x
		ORDER BY id`
	if distributedTx(tx) {
		// On Citus a subquery joins a distributed table to itself only on
		// the distribution column: a key's jobs are looked for in the
		// job's queue, its type's (a type's queue does not change while it
		// has non-final jobs: check-config refuses it).
		q = strings.ReplaceAll(q, "FROM hipq_job n WHERE n.job_type = j.job_type", "FROM hipq_job n WHERE n.queue = j.queue AND n.job_type = j.job_type")
	}
	rows, err := tx.Query(ctx, q, args)
	if err != nil {
		return step{}, fmt.Errorf("walk jobs: %w", err)
	}
	var st step
	var fresh []IntakeJob
	for rows.Next() {
		var newest bool
		old, err := scanJobAnd(rows, &newest)
		if err != nil {
			rows.Close()
			return st, fmt.Errorf("walk jobs: %w", err)
		}
		st.matched++
		st.last = old.ID
		if jt := w.Types[old.JobType]; newest && jt != nil {
			fresh = append(fresh, IntakeJob{Job: replayOf(old, jt, time.Now())})
		}
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("walk jobs: %w", err)
	}
	inserted, _, _, _, err := jobsAccept(ctx, tx, fresh, "")
	if err != nil {
		return st, fmt.Errorf("replay jobs: %w", err)
	}
	st.done = inserted
	return st, nil
}

// replayOf is the new job a replay of old makes: same type, key and data,
// the defaults of its type as configured now (of the old row when jt is
// nil), due now or at the next opening of its time windows.
func replayOf(old *correlator.Job, jt *correlator.JobType, now time.Time) *correlator.Job {
	j := &correlator.Job{Queue: old.Queue, JobType: old.JobType, JobKey: old.JobKey, JobData: old.JobData,
		MaxAttempts: old.MaxAttempts, Priority: old.Priority, ThrottleFactor: old.ThrottleFactor,
		TimeWindows: old.TimeWindows, TimeoutSeconds: old.TimeoutSeconds}
	if jt != nil {
		j.Queue = jt.Queue
		if jt.Retry != nil {
			j.MaxAttempts = jt.Retry.MaxAttempts()
		}
		if windows := correlator.WindowsFor(jt, j.TimeWindows); len(windows) > 0 {
			j.ScheduledRunTime = correlator.NextAllowed(windows, now)
		}
	}
	return j
}

// deadLettersReplayBatch replays the next batch of dead letters, as
// single replays would, in one transaction: intake and outbox records
// become jobs (a duplicate of a non-final job with the same data counts
// as replayed, one with other data is skipped), replies and callbacks go
// through the reply table (one refused again is skipped, and not
// dead-lettered a second time). Each replayed one gets its replayed_at;
// one replayed meanwhile (locked, then found replayed) is skipped.
func deadLettersReplayBatch(ctx context.Context, tx pgx.Tx, ev *Events, op Operation, w OperationWork) (step, error) {
	args := pgx.NamedArgs{"cursor": op.Cursor, "until": op.Until, "n": w.Batch}
	rows, err := tx.Query(ctx, `SELECT d.id FROM hipq_dead_letter d
		WHERE d.id > @cursor AND d.id <= @until AND `+op.DeadLetters.where(args)+` ORDER BY d.id LIMIT @n`, args)
	if err != nil {
		return step{}, fmt.Errorf("walk dead letters: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(ids) == 0 {
		return step{}, err
	}
	st := step{matched: len(ids), last: ids[len(ids)-1]}
	// Locked as a single replay locks its row; those replayed since the
	// walk read them are no longer in the filter.
	rows, err = tx.Query(ctx, `SELECT `+deadLetterColumns+` FROM hipq_dead_letter
		WHERE id = ANY($1) AND replayed_at IS NULL ORDER BY id FOR UPDATE`, ids)
	if err != nil {
		return st, fmt.Errorf("lock dead letters: %w", err)
	}
	dls, err := scanDeadLetters(rows)
	if err != nil {
		return st, fmt.Errorf("lock dead letters: %w", err)
	}
	var jobs []IntakeJob
	jobOf := map[*correlator.Job]int64{}
	var replies []ReplyIn
	var replyOf []int64
	for _, d := range dls {
		j, in, err := w.DecodeDeadLetter(d)
		switch {
		case err != nil: // refused again: skipped
		case j != nil:
			jobs = append(jobs, IntakeJob{Job: j})
			jobOf[j] = d.ID
		case in != nil:
			replies = append(replies, *in)
			replyOf = append(replyOf, d.ID)
		}
	}
	var replayed []int64
	_, _, conflicts, _, err := jobsAccept(ctx, tx, jobs, "")
	if err != nil {
		return st, fmt.Errorf("replay intake dead letters: %w", err)
	}
	refused := make(map[*correlator.Job]bool, len(conflicts))
	for _, c := range conflicts {
		refused[c.Job] = true
	}
	for _, ij := range jobs {
		if !refused[ij.Job] {
			replayed = append(replayed, jobOf[ij.Job])
		}
	}
	res, err := applyReplies(ctx, tx, ev, replies, w.Types, w.EarlyTTL, time.Time{})
	if err != nil {
		return st, fmt.Errorf("replay reply dead letters: %w", err)
	}
	for i, v := range res.Verdicts {
		if v != correlator.DeadLetter {
			replayed = append(replayed, replyOf[i])
		}
	}
	if len(replayed) > 0 {
		tag, err := tx.Exec(ctx, `UPDATE hipq_dead_letter SET replayed_at = now() WHERE id = ANY($1) AND replayed_at IS NULL`, replayed)
		if err != nil {
			return st, fmt.Errorf("mark dead letters replayed: %w", err)
		}
		st.done = int(tag.RowsAffected())
	}
	return st, nil
}

package store

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// ErrConflict is returned when a non-final job of the (type, key) exists
// and stands in the way: other job_data for an enqueue, any for a replay.
var ErrConflict = errors.New("a non-final job with this job_type and job_key exists")

// ErrFinal is returned when an operation needs a non-final job and the
// (type, key) has only final ones.
var ErrFinal = errors.New("the job is final")

// enqueueInsertSQL is the API's insert of one job (named arguments), its
// conflict target left to its layout's statement.
const enqueueInsertSQL = `INSERT INTO hipq_job (queue, job_type, job_key, job_data, max_attempts, priority, throttle_factor,
			                      timeout_seconds, scheduled_run_time, expires_at, time_windows, trace_parent, trace_state,
			                      reply_to, correlation)
			VALUES (@queue, @job_type, @job_key, @job_data::jsonb, @max_attempts, @priority, @throttle_factor, @timeout_seconds,
			        coalesce(@scheduled_run_time::timestamptz, now()), @expires_at, @time_windows::jsonb, @trace_parent, @trace_state,
			        @reply_to, @correlation::jsonb)`

// JobEnqueue inserts j unless a non-final job of its (type, key) exists.
// It returns the stored job and whether it is new; an existing one with
// other job_data is ErrConflict (returned with that job). One statement
// inserts the job or reads the one in its way, on one snapshot: a job
// going final meanwhile can never make a second insert of the same
// request, nor a conflict pass for a duplicate. (On Citus, two statements:
// see jobEnqueueDistributed.)
func (s *Store) JobEnqueue(ctx context.Context, j *correlator.Job) (*correlator.Job, bool, error) {
	var windows *string
	if j.TimeWindows != nil {
		b, _ := json.Marshal(j.TimeWindows)
		w := string(b)
		windows = &w
	}
	args := pgx.StrictNamedArgs{"queue": j.Queue, "job_type": j.JobType, "job_key": j.JobKey, "job_data": string(j.JobData),
		"max_attempts": j.MaxAttempts, "priority": j.Priority, "throttle_factor": j.ThrottleFactor,
		"timeout_seconds": j.TimeoutSeconds, "scheduled_run_time": scheduled(j), "expires_at": j.ExpiresAt,
		"time_windows": windows, "trace_parent": nullable(j.Trace.Parent), "trace_state": nullable(j.Trace.State),
		"reply_to": nullable(j.ReplyTo), "correlation": correlationJSON(j.Correlation)}
	try := func() (cur *correlator.Job, created, same bool, err error) {
		cur, err = scanJobAnd(s.pool.QueryRow(ctx, `
			WITH ins AS (
			  `+enqueueInsertSQL+`
			  ON CONFLICT (job_type, job_key) WHERE state <> 'final' DO NOTHING
			  RETURNING `+jobColumns+`
			), notify AS (
			  SELECT pg_notify('`+channelJobReady+`', @queue) FROM ins
			)
			SELECT ins.*, true, true FROM ins WHERE (SELECT count(*) FROM notify) >= 0
			UNION ALL
			SELECT `+jobColumns+`, false, job_data = @job_data::jsonb FROM hipq_job
			WHERE job_type = @job_type AND job_key = @job_key AND state <> 'final' AND NOT EXISTS (SELECT 1 FROM ins)`, args),
			&created, &same)
		return cur, created, same, err
	}
	if s.dist {
		try = func() (*correlator.Job, bool, bool, error) { return s.jobEnqueueDistributed(ctx, j, args) }
	}
	for range 10 {
		cur, created, same, err := try()
		switch {
		case errors.Is(err, correlator.ErrNotFound):
			// The insert met a row committed after its snapshot, or (on
			// Citus) the job in its way went final before the lookup: again.
			continue
		case err != nil:
			return nil, false, fmt.Errorf("enqueue %s/%s: %w", j.JobType, j.JobKey, err)
		case created:
			return cur, true, nil
		case !same:
			return cur, false, ErrConflict
		}
		return cur, false, nil
	}
	return nil, false, fmt.Errorf("enqueue %s/%s: the key's job kept changing under the insert: %w", j.JobType, j.JobKey, errRaced)
}

// jobEnqueueDistributed is one try of JobEnqueue on Citus: the insert (its
// conflict target the non-final key there, (queue, job_type, job_key))
// and, when it met a job in its way, the lookup of that job are two
// statements of one transaction, each naming the job's queue; the second
// sees what committed after the first, so a job in the way that went
// final meanwhile is correlator.ErrNotFound (the insert runs again).
func (s *Store) jobEnqueueDistributed(ctx context.Context, j *correlator.Job, args pgx.StrictNamedArgs) (cur *correlator.Job, created, same bool, err error) {
	err = s.inTx(ctx, func(tx pgx.Tx) error {
		var err error
		cur, err = scanJob(tx.QueryRow(ctx, `/* enqueues in one queue */ `+enqueueInsertSQL+`
			ON CONFLICT (queue, job_type, job_key) WHERE state <> 'final' DO NOTHING
			RETURNING `+jobColumns, args))
		if err == nil {
			created = true
			_, err = tx.Exec(ctx, "SELECT pg_notify('"+channelJobReady+"', $1)", j.Queue)
			return err
		}
		if !errors.Is(err, correlator.ErrNotFound) {
			return err
		}
		cur, err = scanJobAnd(tx.QueryRow(ctx, `/* finds the job in the way in one queue */
			SELECT `+jobColumns+`, job_data = @job_data::jsonb FROM hipq_job
			WHERE queue = @queue AND job_type = @job_type AND job_key = @job_key AND state <> 'final'`,
			pgx.NamedArgs{"queue": j.Queue, "job_type": j.JobType, "job_key": j.JobKey, "job_data": string(j.JobData)}), &same)
		return err
	})
	return cur, created, same, err
}

// scanJobAnd scans a job followed by extra columns.
func scanJobAnd(row pgx.Row, extra ...any) (*correlator.Job, error) {
	return scanJob(rowWithExtra{row, extra})
}

type rowWithExtra struct {
	pgx.Row
	extra []any
}

func (r rowWithExtra) Scan(dest ...any) error { return r.Row.Scan(append(dest, r.extra...)...) }

// Attempt is one row of hipq_attempt.
type Attempt struct {
	JobID        int64           `json:"job_id"`
	Attempt      int             `json:"attempt"`
	Instance     string          `json:"instance"`
	DispatchedAt time.Time       `json:"dispatched_at"`
	SentAt       *time.Time      `json:"sent_at"`
	RepliedAt    *time.Time      `json:"replied_at"`
	Outcome      *string         `json:"outcome"`
	Error        *string         `json:"error"`
	Reply        json.RawMessage `json:"reply"`
	// Deadline is when the attempt times out, once news moved it; the
	// progress is what the latest news said, at ProgressAt.
	Deadline   *time.Time      `json:"deadline,omitempty"`
	Progress   json.RawMessage `json:"progress,omitempty"`
	ProgressAt *time.Time      `json:"progress_at,omitempty"`
}

// AttemptList returns a job's attempts, first first.
func (s *Store) AttemptList(ctx context.Context, jobID int64) ([]Attempt, error) {
	rows, err := s.pool.Query(ctx, `SELECT job_id, attempt, instance, dispatched_at, sent_at, replied_at, outcome, error, reply,
		deadline, progress, progress_at
		FROM hipq_attempt WHERE job_id = $1 ORDER BY attempt`, jobID)
	if err != nil {
		return nil, fmt.Errorf("list attempts of job %d: %w", jobID, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Attempt, error) {
		var a Attempt
		err := r.Scan(&a.JobID, &a.Attempt, &a.Instance, &a.DispatchedAt, &a.SentAt, &a.RepliedAt, &a.Outcome, &a.Error, &a.Reply,
			&a.Deadline, &a.Progress, &a.ProgressAt)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("list attempts of job %d: %w", jobID, err)
	}
	return out, nil
}

// Page sizes of the lists (jobs, dead letters).
const (
	DefaultListLimit = 100
	MaxListLimit     = 1000
)

// JobListParams filters JobList; empty fields match everything.
type JobListParams struct {
	JobType string
	State   correlator.State
	Queue   string
	// QueueTypes are the job types the config puts in Queue: a queue
	// filter reads their (job_type, job_key) index rather than walk the
	// table for a queue with few jobs.
	QueueTypes []string
	// KeyPrefix keeps the jobs whose job_key starts with it.
	KeyPrefix string
	// BeforeID is the keyset cursor: jobs with smaller ids (newest first);
	// 0 starts from the newest.
	BeforeID int64
	Limit    int
}

// JobList lists jobs newest first.
func (s *Store) JobList(ctx context.Context, p JobListParams) ([]*correlator.Job, error) {
	p.Limit = cmp.Or(p.Limit, DefaultListLimit)
	if p.State == correlator.StateError {
		return nil, nil // transient: a committed row is never left in error (SPEC §2)
	}
	q, args := jobListQuery(p)
	rows, err := s.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("list jobs: %w", err)
	}
	defer rows.Close()
	var out []*correlator.Job
	for rows.Next() {
		j, err := scanJob(rows)
		if err != nil {
			return nil, fmt.Errorf("list jobs: %w", err)
		}
		out = append(out, j)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list jobs: %w", err)
	}
	return out, nil
}

// jobListQuery is JobList's statement: only the filters given, each a
// parameter. Planned for its values (the API's connections plan each
// statement afresh, Config.CustomPlans), each filter reads an index:
// job_type its (job_type, job_key) indexes when the type is rare, else the
// primary key newest first, where it soon finds enough; a waiting or running
// state its partial index; a queue the index of its job types. The
// (job_type, job_key) indexes are two, of non-final and of final jobs, so a
// type or queue filter without a state reads each part and merges.
func jobListQuery(p JobListParams) (string, []any) {
	// (A key prefix alone reads no (job_type, job_key) index: it walks the
	// primary key newest first, once, unsplit.)
	if p.State == "" && (p.JobType != "" || (p.Queue != "" && len(p.QueueTypes) > 0)) {
		live, args := jobListFilter(p).query(`SELECT `+jobColumns+` FROM hipq_job`, p.BeforeID, p.Limit)
		n := len(args)
		final := strings.Replace(live, " WHERE ", " WHERE state = 'final' AND ", 1)
		live = strings.Replace(live, " WHERE ", " WHERE state <> 'final' AND ", 1)
		return fmt.Sprintf(`SELECT * FROM ((%s) UNION ALL (%s)) j ORDER BY id DESC LIMIT $%d`, live, final, n), args
	}
	return jobListFilter(p).query(`SELECT `+jobColumns+` FROM hipq_job`, p.BeforeID, p.Limit)
}

func jobListFilter(p JobListParams) *listFilter {
	f := listFilter{}
	f.add("job_type", p.JobType)
	f.add("state", string(p.State))
	f.add("queue", p.Queue)
	if p.Queue != "" && len(p.QueueTypes) > 0 {
		f.args = append(f.args, p.QueueTypes)
		f.where = append(f.where, fmt.Sprintf("job_type = ANY($%d)", len(f.args)))
	}
	if p.KeyPrefix != "" {
		f.args = append(f.args, p.KeyPrefix)
		f.where = append(f.where, fmt.Sprintf("starts_with(job_key, $%d)", len(f.args)))
	}
	return &f
}

// listFilter builds a keyset-paginated list statement, newest first.
type listFilter struct {
	where []string
	args  []any
}

func (f *listFilter) add(col, v string) {
	if v != "" {
		f.args = append(f.args, v)
		f.where = append(f.where, fmt.Sprintf("%s = $%d", col, len(f.args)))
	}
}

func (f *listFilter) query(sel string, beforeID int64, limit int) (string, []any) {
	if beforeID > 0 {
		f.args = append(f.args, beforeID)
		f.where = append(f.where, fmt.Sprintf("id < $%d", len(f.args)))
	}
	if len(f.where) > 0 {
		sel += " WHERE " + strings.Join(f.where, " AND ")
	}
	f.args = append(f.args, limit)
	return sel + fmt.Sprintf(" ORDER BY id DESC LIMIT $%d", len(f.args)), f.args
}

// JobCancel moves the non-final job of (type, key) to final / cancelled,
// guarded by the state and attempt it was read in; a running attempt is
// marked cancelled (its reply, if one comes, is then a duplicate). It
// returns the cancelled job, ErrFinal when only final jobs exist, or
// correlator.ErrNotFound.
func (s *Store) JobCancel(ctx context.Context, jobType, jobKey string) (*correlator.Job, error) {
	for range 5 {
		cur, err := s.JobGet(ctx, jobType, jobKey)
		if err != nil {
			return nil, err
		}
		if cur.State == correlator.StateFinal {
			return cur, ErrFinal
		}
		var j *correlator.Job
		err = s.inTx(ctx, func(tx pgx.Tx) error {
			var err error
			stmt, args := cancelSQL, []any{cur.ID, string(cur.State), cur.Attempt, correlator.ErrorCancelled, cur.Queue}
			if s.events.On() {
				types, topics, attempts := s.events.args()
				stmt, args = cancelEventsSQL, append(args, types, topics, attempts)
			}
			j, err = scanJob(tx.QueryRow(ctx, stmt, args...))
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `UPDATE hipq_attempt SET outcome = 'cancelled', error = $3
				WHERE queue = $4 AND job_id = $1 AND attempt = $2 AND outcome IS NULL`, cur.ID, cur.Attempt, correlator.ErrorCancelled, cur.Queue)
			if err != nil {
				return err
			}
			// The job ended (a throttle slot may be free; waits look now).
			if distributedTx(tx) { // (and the relay, which no trigger wakes there)
				return notifyCitus(ctx, tx, s.events.On(), j.Queue)
			}
			_, err = tx.Exec(ctx, `SELECT pg_notify('`+channelJobReady+`', $1)`, j.Queue)
			return err
		})
		if errors.Is(err, correlator.ErrNotFound) {
			continue // it moved meanwhile: read it again
		}
		if err != nil {
			return nil, fmt.Errorf("cancel %s/%s: %w", jobType, jobKey, err)
		}
		return j, nil
	}
	return nil, fmt.Errorf("cancel %s/%s: the job kept moving", jobType, jobKey)
}

// cancelSQL ends the job of id $1 in queue $5, in state $2 and attempt
// $3, final / cancelled (error $4), and returns it.
var cancelSQL = `
		WITH done AS (
		  UPDATE hipq_job j SET state = 'final', outcome = 'cancelled', error = $4, update_time = now()
		  WHERE j.queue = $5 AND j.id = $1 AND j.state = $2 AND j.attempt = $3
		  RETURNING j.*
		), /*events*/cancelled AS (SELECT 1)
		SELECT ` + jobColumns + ` FROM done`

// cancelEventsSQL is cancelSQL that writes the job's outcome events too,
// with the routes in $6, $7 and $8.
var cancelEventsSQL = withEvents(cancelSQL, "$6", "$7", "$8")

// JobReplay makes a new job from the latest final job of (type, key): same
// type, key and data, defaults from jt (or the old row's when jt is nil).
// It returns the new job, ErrConflict when a non-final job exists, or
// correlator.ErrNotFound.
func (s *Store) JobReplay(ctx context.Context, jobType, jobKey string, jt *correlator.JobType) (*correlator.Job, error) {
	old, err := s.JobGet(ctx, jobType, jobKey)
	if err != nil {
		return nil, err
	}
	if old.State != correlator.StateFinal {
		return old, ErrConflict
	}
	j := replayOf(old, jt, time.Now())
	cur, created, err := s.JobEnqueue(ctx, j)
	if err == nil && !created {
		err = ErrConflict // a job appeared meanwhile, with the same data
	}
	return cur, err
}

// QueueSetPaused pauses or resumes a queue for every instance's dispatcher.
func (s *Store) QueueSetPaused(ctx context.Context, queue string, paused bool) error {
	// (now() in the values, not in the update: Citus, where hipq_queue is
	// a reference table, evaluates it once on the coordinator there.)
	_, err := s.pool.Exec(ctx, `INSERT INTO hipq_queue (name, paused, updated_at) VALUES ($1, $2, now())
		ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, updated_at = excluded.updated_at`, queue, paused)
	if err != nil {
		return fmt.Errorf("set queue %q paused=%v: %w", queue, paused, err)
	}
	if !paused {
		_, _ = s.pool.Exec(ctx, `SELECT pg_notify('`+channelJobReady+`', $1)`, queue)
	}
	return nil
}

package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

const jobColumns = `id, queue, job_type, job_key, job_data, state, coalesce(outcome, ''), error, attempt, max_attempts,
	scheduled_run_time, priority, throttle_factor, time_windows, timeout_seconds, expires_at, started_at, result,
	created_at, update_time, coalesce(trace_parent, ''), coalesce(trace_state, ''), coalesce(reply_to, '')`

func scanJob(row pgx.Row) (*correlator.Job, error) {
	var j correlator.Job
	var windows []byte
	err := row.Scan(&j.ID, &j.Queue, &j.JobType, &j.JobKey, &j.JobData, &j.State, &j.Outcome, &j.Error, &j.Attempt,
		&j.MaxAttempts, &j.ScheduledRunTime, &j.Priority, &j.ThrottleFactor, &windows, &j.TimeoutSeconds, &j.ExpiresAt,
		&j.StartedAt, &j.Result, &j.CreatedAt, &j.UpdateTime, &j.Trace.Parent, &j.Trace.State, &j.ReplyTo)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, correlator.ErrNotFound
	}
	if err != nil {
		return nil, err
	}
	// Windows this build cannot evaluate are shown as stored (and taken as
	// open): never a reason to refuse reading the job.
	j.TimeWindows, _ = decodeWindows(windows)
	return &j, nil
}

// JobGet returns the non-final job of (type, key), else the latest final
// one, else correlator.ErrNotFound.
func (s *Store) JobGet(ctx context.Context, jobType, jobKey string) (*correlator.Job, error) {
	// Each branch reads its partial index: the unique one of non-final
	// jobs, the final versions' newest first; of the two rows at most, the
	// non-final one. On Citus the newest is the last made: ids drawn on
	// different nodes are not in that order.
	newest := "id DESC"
	if s.dist {
		newest = "created_at DESC, id DESC"
	}
	j, err := scanJob(s.pool.QueryRow(ctx, `SELECT * FROM (
		(SELECT `+jobColumns+` FROM hipq_job WHERE job_type = $1 AND job_key = $2 AND state <> 'final')
		UNION ALL
		(SELECT `+jobColumns+` FROM hipq_job WHERE job_type = $1 AND job_key = $2 AND state = 'final' ORDER BY `+newest+` LIMIT 1)
		) j ORDER BY state = 'final' LIMIT 1`, jobType, jobKey))
	if err != nil && !errors.Is(err, correlator.ErrNotFound) {
		return nil, fmt.Errorf("get job %s/%s: %w", jobType, jobKey, err)
	}
	return j, err
}

// JobGetByID returns one job by id.
func (s *Store) JobGetByID(ctx context.Context, id int64) (*correlator.Job, error) {
	j, err := scanJob(s.pool.QueryRow(ctx, `SELECT `+jobColumns+` FROM hipq_job WHERE id = $1`, id))
	if err != nil && !errors.Is(err, correlator.ErrNotFound) {
		return nil, fmt.Errorf("get job %d: %w", id, err)
	}
	return j, err
}

// JobsEnded returns which of the jobs ids are final or no longer exist.
func (s *Store) JobsEnded(ctx context.Context, ids []int64) ([]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT w.id FROM unnest($1::bigint[]) w(id)
		LEFT JOIN hipq_job j ON j.id = w.id WHERE j.id IS NULL OR j.state = 'final'`, ids)
	if err != nil {
		return nil, fmt.Errorf("look for ended jobs: %w", err)
	}
	ended, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("look for ended jobs: %w", err)
	}
	return ended, nil
}

// JobCountByState counts jobs per state.
func (s *Store) JobCountByState(ctx context.Context) (map[correlator.State]int, error) {
	rows, err := s.pool.Query(ctx, `SELECT state, count(*) FROM hipq_job GROUP BY state`)
	if err != nil {
		return nil, fmt.Errorf("count jobs: %w", err)
	}
	out := map[correlator.State]int{}
	var st string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&st, &n}, func() error { out[correlator.State(st)] = n; return nil })
	if err != nil {
		return nil, fmt.Errorf("count jobs: %w", err)
	}
	return out, nil
}

package store

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// Queue orders.
const (
	OrderScheduledFirst = "scheduled_first"
	OrderPriorityFirst  = "priority_first"
)

// JobClaimParams says which due jobs to claim.
type JobClaimParams struct {
	Queue    string
	Order    string // OrderScheduledFirst (default) or OrderPriorityFirst
	Limit    int
	Instance string // recorded on each hipq_attempt row
	// Types limits the claim to job types this instance can send; nil
	// claims every type.
	Types []string
}

// Claimed is a job moved to running by a claim.
type Claimed struct {
	ID             int64
	Queue          string
	JobType        string
	JobKey         string
	JobData        json.RawMessage
	Attempt        int
	MaxAttempts    int
	TimeoutSeconds int
	ExpiresAt      *time.Time
	TimeWindows    []correlator.TimeWindow
	StartedAt      time.Time
}

// Running returns what the retry decision needs.
func (c *Claimed) Running() correlator.Running {
	return correlator.Running{Attempt: c.Attempt, MaxAttempts: c.MaxAttempts, ExpiresAt: c.ExpiresAt, Windows: c.TimeWindows}
}

// JobClaim moves up to Limit due jobs of one queue to running in one
// statement: attempt+1, started_at, and a hipq_attempt row each. Jobs past
// their expiry are never claimed; locked rows are skipped, so dispatchers on
// many instances never claim the same job.
func (s *Store) JobClaim(ctx context.Context, p JobClaimParams) ([]Claimed, error) {
	order := "scheduled_run_time, priority, id"
	if p.Order == OrderPriorityFirst {
		order = "priority, scheduled_run_time, id"
	}
	rows, err := s.pool.Query(ctx, `
		WITH due AS (
		  SELECT id, state, attempt FROM hipq_job
		  WHERE queue = $1 AND state IN ('initial', 'retry') AND scheduled_run_time <= now()
		    AND (expires_at IS NULL OR expires_at > now())
		    AND ($4::text[] IS NULL OR job_type = ANY($4))
		  ORDER BY `+order+`
		  LIMIT $2
		  FOR UPDATE SKIP LOCKED
		), claimed AS (
		  UPDATE hipq_job j
		  SET state = 'running', attempt = j.attempt + 1, started_at = now(), update_time = now(), error = 'NONE'
		  FROM due
		  WHERE j.id = due.id AND j.state = due.state AND j.attempt = due.attempt
		  RETURNING j.id, j.queue, j.job_type, j.job_key, j.job_data, j.attempt, j.max_attempts,
		            j.timeout_seconds, j.expires_at, j.time_windows, j.started_at
		), att AS (
		  INSERT INTO hipq_attempt (job_id, attempt, instance, dispatched_at)
		  SELECT id, attempt, $3, started_at FROM claimed
		)
		SELECT * FROM claimed ORDER BY id`, p.Queue, p.Limit, p.Instance, p.Types)
	if err != nil {
		return nil, fmt.Errorf("claim due jobs of queue %q: %w", p.Queue, err)
	}
	var out []Claimed
	var c Claimed
	var windows []byte
	_, err = pgx.ForEachRow(rows, []any{&c.ID, &c.Queue, &c.JobType, &c.JobKey, &c.JobData, &c.Attempt, &c.MaxAttempts,
		&c.TimeoutSeconds, &c.ExpiresAt, &windows, &c.StartedAt}, func() error {
		var err error
		if c.TimeWindows, err = decodeWindows(windows); err != nil {
			return fmt.Errorf("job %d: time_windows: %w", c.ID, err)
		}
		c.JobData = append(json.RawMessage(nil), c.JobData...)
		out = append(out, c)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("claim due jobs of queue %q: %w", p.Queue, err)
	}
	return out, nil
}

// AttemptRef names one attempt of one job.
type AttemptRef struct {
	JobID   int64
	Attempt int
}

func refArrays(refs []AttemptRef) ([]int64, []int32) {
	ids, atts := make([]int64, len(refs)), make([]int32, len(refs))
	for i, r := range refs {
		ids[i], atts[i] = r.JobID, int32(r.Attempt)
	}
	return ids, atts
}

// AttemptMarkSent records that the transport acknowledged the sends.
func (s *Store) AttemptMarkSent(ctx context.Context, refs []AttemptRef) error {
	if len(refs) == 0 {
		return nil
	}
	ids, atts := refArrays(refs)
	_, err := s.pool.Exec(ctx, `
		UPDATE hipq_attempt a SET sent_at = now()
		FROM unnest($1::bigint[], $2::int[]) AS u(id, att)
		WHERE a.job_id = u.id AND a.attempt = u.att AND a.sent_at IS NULL`, ids, atts)
	if err != nil {
		return fmt.Errorf("mark attempts sent: %w", err)
	}
	return nil
}

// JobUndoClaim takes back claims whose request never left (invariant 8):
// state, attempt, started_at and error are restored and the hipq_attempt row
// deleted, guarded by state running, the attempt, and no sent_at. It returns
// how many were undone.
func (s *Store) JobUndoClaim(ctx context.Context, refs []AttemptRef) (int, error) {
	if len(refs) == 0 {
		return 0, nil
	}
	ids, atts := refArrays(refs)
	var n int
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, `
			WITH u AS (
			  SELECT * FROM unnest($1::bigint[], $2::int[]) AS u(id, att)
			), undone AS (
			  UPDATE hipq_job j
			  SET state = CASE WHEN j.attempt = 1 THEN 'initial' ELSE 'retry' END,
			      attempt = j.attempt - 1,
			      started_at = prev.dispatched_at,
			      error = coalesce(prev.error, 'NONE'),
			      update_time = now()
			  FROM u
			  LEFT JOIN hipq_attempt prev ON prev.job_id = u.id AND prev.attempt = u.att - 1
			  WHERE j.id = u.id AND j.state = 'running' AND j.attempt = u.att
			    AND EXISTS (SELECT 1 FROM hipq_attempt a
			                WHERE a.job_id = u.id AND a.attempt = u.att AND a.sent_at IS NULL AND a.outcome IS NULL)
			  RETURNING j.id, u.att
			), del AS (
			  DELETE FROM hipq_attempt a USING undone
			  WHERE a.job_id = undone.id AND a.attempt = undone.att
			  RETURNING 1
			)
			SELECT count(*) FROM del`, ids, atts).Scan(&n)
	})
	if err != nil {
		return 0, fmt.Errorf("undo claims: %w", err)
	}
	return n, nil
}

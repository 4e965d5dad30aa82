package store

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// IntakeJob is a new job with the record it came from.
type IntakeJob struct {
	Job    *correlator.Job
	Source Source
}

// IntakeBatch is everything one poll of the intake consumer commits at once.
type IntakeBatch struct {
	Group       string
	Offsets     []OffsetAdvance
	Jobs        []IntakeJob // unique per (type, key): the caller reduces first
	DeadLetters []DeadLetter
}

// IntakeResult says what the batch did.
type IntakeResult struct {
	Inserted    int
	Duplicates  int          // a non-final job with the same job_data existed
	DeadLetters []DeadLetter // the batch's own plus conflicts found here
}

// IntakeApply writes a batch of intake records in one transaction: the
// offsets compare-and-set, the new jobs (a record for a (type, key) with a
// non-final job is a duplicate, or a conflict when its job_data differs),
// and the dead letters. It returns ErrOffsetConflict, writing nothing, when
// another consumer applied these records first.
func (s *Store) IntakeApply(ctx context.Context, b IntakeBatch) (IntakeResult, error) {
	var res IntakeResult
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		res = IntakeResult{DeadLetters: append([]DeadLetter(nil), b.DeadLetters...)}
		if err := offsetsAdvance(ctx, tx, b.Group, b.Offsets); err != nil {
			return err
		}
		var conflicts []IntakeJob
		var err error
		if res.Inserted, res.Duplicates, conflicts, err = jobsAccept(ctx, tx, b.Jobs); err != nil {
			return err
		}
		for _, ij := range conflicts {
			res.DeadLetters = append(res.DeadLetters, DeadLetter{Kind: SourceIntake, Source: ij.Source,
				Reason: correlator.CodeConflict + ": a non-final job with this job_type and job_key has other job_data"})
		}
		return deadLettersInsert(ctx, tx, res.DeadLetters)
	})
	return res, err
}

// jobsAccept inserts jobs as intake does: a job whose (type, key) has a
// non-final job already is a duplicate when their job_data agree, else a
// conflict, returned for the caller to refuse.
func jobsAccept(ctx context.Context, tx pgx.Tx, jobs []IntakeJob) (inserted, duplicates int, conflicts []IntakeJob, err error) {
	ins, err := jobsInsert(ctx, tx, jobs)
	if err != nil {
		return 0, 0, nil, err
	}
	var dup []IntakeJob
	for _, ij := range jobs {
		if !ins[typeKey{ij.Job.JobType, ij.Job.JobKey}] {
			dup = append(dup, ij)
		}
	}
	conflicting, err := jobsConflicting(ctx, tx, dup)
	if err != nil {
		return 0, 0, nil, err
	}
	for _, ij := range dup {
		if conflicting[typeKey{ij.Job.JobType, ij.Job.JobKey}] {
			conflicts = append(conflicts, ij)
		} else {
			duplicates++
		}
	}
	return len(ins), duplicates, conflicts, nil
}

type typeKey struct{ Type, Key string }

// JobsInsert inserts jobs outside a consumer batch (API, Go client, tests),
// returning the (type, key) pairs that were new.
func (s *Store) JobsInsert(ctx context.Context, jobs []*correlator.Job) (int, error) {
	ij := make([]IntakeJob, len(jobs))
	for i, j := range jobs {
		ij[i].Job = j
	}
	var n int
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		ins, err := jobsInsert(ctx, tx, ij)
		n = len(ins)
		return err
	})
	return n, err
}

func jobsInsert(ctx context.Context, tx pgx.Tx, jobs []IntakeJob) (map[typeKey]bool, error) {
	if len(jobs) == 0 {
		return nil, nil
	}
	n := len(jobs)
	queues, types, keys, data := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	maxAtt, prio, factor, timeout := make([]int32, n), make([]int32, n), make([]int32, n), make([]int32, n)
	sched := make([]time.Time, n)
	expires := make([]*time.Time, n)
	windows := make([]*string, n)
	for i, ij := range jobs {
		j := ij.Job
		queues[i], types[i], keys[i], data[i] = j.Queue, j.JobType, j.JobKey, string(j.JobData)
		maxAtt[i], prio[i], factor[i], timeout[i] = int32(j.MaxAttempts), int32(j.Priority), int32(j.ThrottleFactor), int32(j.TimeoutSeconds)
		sched[i], expires[i] = j.ScheduledRunTime, j.ExpiresAt
		if j.TimeWindows != nil {
			b, _ := json.Marshal(j.TimeWindows)
			w := string(b)
			windows[i] = &w
		}
	}
	rows, err := tx.Query(ctx, `
		WITH ins AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, job_data, max_attempts, priority, throttle_factor,
		                        timeout_seconds, scheduled_run_time, expires_at, time_windows)
		  SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::int[], $6::int[], $7::int[],
		                       $8::int[], $9::timestamptz[], $10::timestamptz[], $11::jsonb[])
		  ON CONFLICT (job_type, job_key) WHERE state <> 'final' DO NOTHING
		  RETURNING queue, job_type, job_key
		), notify AS (
		  SELECT pg_notify('hipq_job_ready', q) FROM (SELECT DISTINCT queue AS q FROM ins) d
		)
		SELECT job_type, job_key FROM ins WHERE (SELECT count(*) FROM notify) >= 0`,
		queues, types, keys, data, maxAtt, prio, factor, timeout, sched, expires, windows)
	if err != nil {
		return nil, fmt.Errorf("insert jobs: %w", err)
	}
	out := make(map[typeKey]bool, n)
	var tk typeKey
	if _, err := pgx.ForEachRow(rows, []any{&tk.Type, &tk.Key}, func() error { out[tk] = true; return nil }); err != nil {
		return nil, fmt.Errorf("insert jobs: %w", err)
	}
	return out, nil
}

// jobsConflicting returns which of jobs have a non-final job with other
// job_data (jsonb equality: key order and spacing do not matter).
func jobsConflicting(ctx context.Context, tx pgx.Tx, jobs []IntakeJob) (map[typeKey]bool, error) {
	if len(jobs) == 0 {
		return nil, nil
	}
	types, keys, data := make([]string, len(jobs)), make([]string, len(jobs)), make([]string, len(jobs))
	for i, ij := range jobs {
		types[i], keys[i], data[i] = ij.Job.JobType, ij.Job.JobKey, string(ij.Job.JobData)
	}
	rows, err := tx.Query(ctx, `
		SELECT j.job_type, j.job_key
		FROM unnest($1::text[], $2::text[], $3::jsonb[]) AS n(job_type, job_key, job_data)
		JOIN hipq_job j ON j.job_type = n.job_type AND j.job_key = n.job_key AND j.state <> 'final'
		WHERE j.job_data <> n.job_data`, types, keys, data)
	if err != nil {
		return nil, fmt.Errorf("find conflicting jobs: %w", err)
	}
	out := map[typeKey]bool{}
	var tk typeKey
	if _, err := pgx.ForEachRow(rows, []any{&tk.Type, &tk.Key}, func() error { out[tk] = true; return nil }); err != nil {
		return nil, fmt.Errorf("find conflicting jobs: %w", err)
	}
	return out, nil
}

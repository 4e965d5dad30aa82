package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// ScheduleState is a schedule's row.
type ScheduleState struct {
	Name       string
	LastFire   time.Time
	Paused     bool
	LastJobKey string
}

// ScheduleSync makes a row for each schedule that has none, with
// last_fire at PostgreSQL's now(): a new schedule never backfills. Rows of
// schedules no longer configured are kept (they hold their last fire time
// should the schedule come back); a schedule whose cron changed keeps its
// row and so its last fire time.
func (s *Store) ScheduleSync(ctx context.Context, names []string) error {
	_, err := s.pool.Exec(ctx, `
		INSERT INTO hipq_schedule (name, last_fire) SELECT n, now() FROM unnest($1::text[]) n
		ON CONFLICT (name) DO NOTHING`, names)
	if err != nil {
		return fmt.Errorf("create schedule rows: %w", err)
	}
	return nil
}

// ScheduleStates reads every schedule row, and PostgreSQL's now(): the
// clock ticks are measured on.
func (s *Store) ScheduleStates(ctx context.Context) (map[string]ScheduleState, time.Time, error) {
	rows, err := s.pool.Query(ctx, `SELECT name, last_fire, paused, coalesce(last_job_key, ''), now() FROM hipq_schedule`)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("read schedules: %w", err)
	}
	out := map[string]ScheduleState{}
	var st ScheduleState
	var now time.Time
	if _, err := pgx.ForEachRow(rows, []any{&st.Name, &st.LastFire, &st.Paused, &st.LastJobKey, &now}, func() error {
		out[st.Name] = st
		return nil
	}); err != nil {
		return nil, time.Time{}, fmt.Errorf("read schedules: %w", err)
	}
	if now.IsZero() {
		if err := s.pool.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
			return nil, time.Time{}, fmt.Errorf("read schedules: %w", err)
		}
	}
	return out, now, nil
}

// Fired is what one look at a schedule did.
type Fired struct {
	Enqueued  int // jobs inserted
	Duplicate int // a non-final job had the tick's key already
	Skipped   int // overlap: skip, the last job was not final
	Dropped   int // missed ticks catch_up left out
	Failed    int // the tick's job could not be built (logged with Errors)
	Errors    []error
	LastFire  time.Time // after the look
	Paused    bool
}

// ScheduleFire fires the due ticks of sch, in one transaction: it locks the
// schedule's row, reads PostgreSQL's now(), lets the schedule's plan decide
// (watchedSince: when this scheduler first looked), inserts the jobs and
// moves last_fire by compare-and-set. Two instances looking at once take
// turns on the row; the second finds nothing due.
func (s *Store) ScheduleFire(ctx context.Context, sch *correlator.Schedule, jt *correlator.JobType, watchedSince time.Time) (Fired, error) {
	var f Fired
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		f = Fired{}
		var last, now time.Time
		var lastKey string
		var running bool
		var err error
		if distributedTx(tx) {
			last, f.Paused, lastKey, now, running, err = scheduleLockDistributed(ctx, tx, sch.Name)
		} else {
			err = tx.QueryRow(ctx, `
				SELECT s.last_fire, s.paused, coalesce(s.last_job_key, ''), now(),
				       EXISTS (SELECT 1 FROM hipq_job j WHERE j.job_type = s.last_job_type AND j.job_key = s.last_job_key AND j.state <> 'final')
				FROM hipq_schedule s WHERE s.name = $1 FOR UPDATE OF s`, sch.Name).Scan(&last, &f.Paused, &lastKey, &now, &running)
		}
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("schedule %s has no row: %w", sch.Name, correlator.ErrNotFound)
		}
		if err != nil {
			return fmt.Errorf("lock schedule %s: %w", sch.Name, err)
		}
		f.LastFire = last
		if f.Paused {
			return nil
		}
		plan := sch.Plan(last, now, watchedSince)
		if plan.Last.IsZero() {
			return nil
		}
		f.Dropped = plan.Dropped
		for _, tick := range plan.Fire {
			if sch.Overlap == correlator.OverlapSkip && running {
				f.Skipped++
				continue
			}
			key, inserted, err := scheduleInsert(ctx, tx, sch, jt, tick, now)
			switch {
			case errors.As(err, new(*correlator.InputError)): // the tick's job cannot be built
				f.Failed++
				f.Errors = append(f.Errors, err)
				continue
			case err != nil:
				return err
			case inserted:
				f.Enqueued++
			default:
				f.Duplicate++
			}
			lastKey, running = key, true
		}
		tag, err := tx.Exec(ctx, `
			UPDATE hipq_schedule SET last_fire = $2, last_job_type = $3, last_job_key = nullif($4, ''), update_time = now()
			WHERE name = $1 AND last_fire = $5`, sch.Name, plan.Last, sch.JobType, lastKey, last)
		if err != nil {
			return fmt.Errorf("move schedule %s: %w", sch.Name, err)
		}
		if tag.RowsAffected() != 1 {
			return fmt.Errorf("move schedule %s: %w", sch.Name, errRaced)
		}
		f.LastFire = plan.Last
		return nil
	})
	return f, err
}

// scheduleLockDistributed is ScheduleFire's lock of the schedule's row on
// Citus, where hipq_schedule is a reference table and hipq_job is
// distributed: Citus locks no rows in a statement that also reads a
// distributed table, so the row is locked alone, and whether the
// schedule's last job is still non-final is read after, in a statement of
// its own (over every queue: the job's queue is not kept, and its type may
// have moved). That read sees what committed before the lock was taken.
func scheduleLockDistributed(ctx context.Context, tx pgx.Tx, name string) (last time.Time, paused bool, lastKey string, now time.Time, running bool, err error) {
	var lastType string
	err = tx.QueryRow(ctx, `/* locks a reference table's row */
		SELECT last_fire, paused, coalesce(last_job_type, ''), coalesce(last_job_key, ''), now()
		FROM hipq_schedule WHERE name = $1 FOR UPDATE`, name).Scan(&last, &paused, &lastType, &lastKey, &now)
	if err != nil || lastType == "" || lastKey == "" {
		return last, paused, lastKey, now, false, err
	}
	err = tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM hipq_job WHERE job_type = $1 AND job_key = $2 AND state <> 'final')`,
		lastType, lastKey).Scan(&running)
	return last, paused, lastKey, now, running, err
}

// scheduleInsert inserts the job of sch's tick at tick, on the caller's
// transaction; it returns the key and whether the job is new (false: a
// non-final job of that key was there).
func scheduleInsert(ctx context.Context, tx pgx.Tx, sch *correlator.Schedule, jt *correlator.JobType, tick, now time.Time) (string, bool, error) {
	req, err := sch.Request(tick)
	if err != nil {
		return "", false, err
	}
	job, err := correlator.NewJob(req, jt, now)
	if err != nil {
		return "", false, err
	}
	n, _, _, _, err := jobsAccept(ctx, tx, []IntakeJob{{Job: job}}, "")
	if err != nil {
		return "", false, err
	}
	return job.JobKey, n == 1, nil
}

// ScheduleTrigger enqueues sch's job now, outside its timetable (the tick
// time is PostgreSQL's now()); last_fire does not move. It returns the
// job's key and whether it is new.
func (s *Store) ScheduleTrigger(ctx context.Context, sch *correlator.Schedule, jt *correlator.JobType) (key string, created bool, err error) {
	err = s.inTx(ctx, func(tx pgx.Tx) error {
		var now time.Time
		err := tx.QueryRow(ctx, `SELECT now() FROM hipq_schedule WHERE name = $1 FOR UPDATE`, sch.Name).Scan(&now)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("schedule %s: %w", sch.Name, correlator.ErrNotFound)
		}
		if err != nil {
			return fmt.Errorf("trigger schedule %s: %w", sch.Name, err)
		}
		if key, created, err = scheduleInsert(ctx, tx, sch, jt, now, now); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE hipq_schedule SET last_job_type = $2, last_job_key = $3, update_time = now() WHERE name = $1`,
			sch.Name, sch.JobType, key)
		return err
	})
	return key, created, err
}

// ScheduleSetPaused pauses or resumes a schedule. Ticks due while paused
// are passed over: resuming moves last_fire to now, never backfilling.
func (s *Store) ScheduleSetPaused(ctx context.Context, name string, paused bool) error {
	if s.dist {
		return s.scheduleSetPausedDistributed(ctx, name, paused)
	}
	tag, err := s.pool.Exec(ctx, `
		UPDATE hipq_schedule SET paused = $2, update_time = now(),
		       last_fire = CASE WHEN paused AND NOT $2 THEN greatest(last_fire, now()) ELSE last_fire END
		WHERE name = $1`, name, paused)
	if err != nil {
		return fmt.Errorf("pause schedule %s: %w", name, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("schedule %s: %w", name, correlator.ErrNotFound)
	}
	return nil
}

// scheduleSetPausedDistributed is ScheduleSetPaused on Citus, which
// refuses a write whose CASE calls now() (a function it must evaluate on
// the coordinator, and will not inside a branch): the transaction's now()
// is read first and passed in, the same time now() gives in the update.
func (s *Store) scheduleSetPausedDistributed(ctx context.Context, name string, paused bool) error {
	return s.inTx(ctx, func(tx pgx.Tx) error {
		var now time.Time
		if err := tx.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
			return fmt.Errorf("pause schedule %s: %w", name, err)
		}
		tag, err := tx.Exec(ctx, `/* pauses with the transaction's now() passed in */
			UPDATE hipq_schedule SET paused = $2, update_time = now(),
			       last_fire = CASE WHEN paused AND NOT $2 THEN greatest(last_fire, $3::timestamptz) ELSE last_fire END
			WHERE name = $1`, name, paused, now)
		if err != nil {
			return fmt.Errorf("pause schedule %s: %w", name, err)
		}
		if tag.RowsAffected() == 0 {
			return fmt.Errorf("schedule %s: %w", name, correlator.ErrNotFound)
		}
		return nil
	})
}

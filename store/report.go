package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Figures the demo and the bench print. They read whole tables: tools,
// not the hot path.

// Summary is what became of every job in the schema.
type Summary struct {
	Succeeded, Failed, Retried, Attempts, TimedOutAttempts, DeadLetters int
}

// RunSummary counts outcomes, attempts and dead letters.
func (s *Store) RunSummary(ctx context.Context) (Summary, error) {
	var r Summary
	err := s.pool.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE outcome = 'succeeded'), count(*) FILTER (WHERE outcome = 'failed'),
		       (SELECT count(*) FROM hipq_attempt WHERE outcome = 'timed_out'),
		       count(*) FILTER (WHERE attempt > 1), coalesce(sum(attempt), 0),
		       (SELECT count(*) FROM hipq_dead_letter)
		FROM hipq_job`).Scan(&r.Succeeded, &r.Failed, &r.TimedOutAttempts, &r.Retried, &r.Attempts, &r.DeadLetters)
	if err != nil {
		return r, fmt.Errorf("summarize jobs: %w", err)
	}
	return r, nil
}

// Latencies are percentiles, in milliseconds, of succeeded jobs whose
// job_data.t holds the Unix time in nanoseconds at which they were
// produced (as hipq bench writes them).
type Latencies struct {
	Last                 time.Time  // the last job's end
	P50, P99             float64    // produced → final
	Intake, Claim, Reply [2]float64 // p50, p99 of produced → stored, stored → claimed, claimed → final
}

// BenchLatencies reads the latencies of a bench run.
func (s *Store) BenchLatencies(ctx context.Context) (Latencies, error) {
	var l Latencies
	err := s.pool.QueryRow(ctx, `
		SELECT max(update_time),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY lat), percentile_cont(0.99) WITHIN GROUP (ORDER BY lat),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY intake), percentile_cont(0.99) WITHIN GROUP (ORDER BY intake),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY claim), percentile_cont(0.99) WITHIN GROUP (ORDER BY claim),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY reply), percentile_cont(0.99) WITHIN GROUP (ORDER BY reply)
		FROM (SELECT update_time,
		             (extract(epoch FROM update_time) * 1e9 - (job_data->>'t')::float8) / 1e6 AS lat,
		             (extract(epoch FROM created_at) * 1e9 - (job_data->>'t')::float8) / 1e6 AS intake,
		             extract(epoch FROM started_at - created_at) * 1e3 AS claim,
		             extract(epoch FROM update_time - started_at) * 1e3 AS reply
		      FROM hipq_job WHERE outcome = 'succeeded') l`).Scan(&l.Last, &l.P50, &l.P99,
		&l.Intake[0], &l.Intake[1], &l.Claim[0], &l.Claim[1], &l.Reply[0], &l.Reply[1])
	if err != nil {
		return l, fmt.Errorf("read bench latencies: %w", err)
	}
	return l, nil
}

// OutboxWrite commits values (intake JSON) to the outbox in one
// transaction, as an application would.
func (s *Store) OutboxWrite(ctx context.Context, values []string) error {
	if _, err := s.pool.Exec(ctx, `INSERT INTO hipq_intake (value) SELECT unnest($1::text[])`, values); err != nil {
		return fmt.Errorf("write the outbox: %w", err)
	}
	return nil
}

// DropSchema drops the store's schema and everything in it: for sandboxes
// on a shared database. It refuses the public schema.
func (s *Store) DropSchema(ctx context.Context) error {
	if s.schema == DefaultSchema {
		return fmt.Errorf("drop schema: refusing to drop public")
	}
	if _, err := s.pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{s.schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("drop schema %s: %w", s.schema, err)
	}
	return nil
}

package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// JobCount is the number of jobs of one queue in one state.
type JobCount struct {
	Queue, State string
	N            int64
}

// JobCounts counts jobs by queue and state, for hipq_jobs.
func (s *Store) JobCounts(ctx context.Context) ([]JobCount, error) {
	rows, err := s.pool.Query(ctx, "SELECT queue, state::text, count(*) FROM hipq_job GROUP BY 1, 2")
	if err != nil {
		return nil, fmt.Errorf("count jobs: %w", err)
	}
	var out []JobCount
	var jc JobCount
	if _, err := pgx.ForEachRow(rows, []any{&jc.Queue, &jc.State, &jc.N}, func() error { out = append(out, jc); return nil }); err != nil {
		return nil, fmt.Errorf("count jobs: %w", err)
	}
	return out, nil
}

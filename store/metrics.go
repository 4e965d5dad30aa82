package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// JobCounts counts the non-final jobs by queue and state, for hipq_jobs,
// through the partial index of non-final jobs: never the final rows
// retention keeps (a scan of millions at every scrape).
func (s *Store) JobCounts(ctx context.Context) ([]correlator.JobCount, error) {
	rows, err := s.pool.Query(ctx, "SELECT queue, state::text, count(*) FROM hipq_job WHERE state <> 'final' GROUP BY 1, 2")
	if err != nil {
		return nil, fmt.Errorf("count jobs: %w", err)
	}
	var out []correlator.JobCount
	var jc correlator.JobCount
	var state string
	if _, err := pgx.ForEachRow(rows, []any{&jc.Queue, &state, &jc.N}, func() error {
		jc.State = correlator.State(state)
		out = append(out, jc)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("count jobs: %w", err)
	}
	return out, nil
}

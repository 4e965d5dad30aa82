package store

import (
	"context"

	"github.com/hipq/hipq/correlator"
)

// JobCounts counts the non-final jobs by queue and state, for hipq_jobs
// (QueueCounts: never the final rows retention keeps).
func (s *Store) JobCounts(ctx context.Context) ([]correlator.JobCount, error) {
	counts, err := s.QueueCounts(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]correlator.JobCount, len(counts))
	for i, c := range counts {
		out[i] = correlator.JobCount{Queue: c.Queue, State: correlator.State(c.State), N: c.N}
	}
	return out, nil
}

package main

import (
	"context"
	"fmt"

	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/store"
)

func openStore(ctx context.Context, cfg *config.Config) (*store.Store, error) {
	return store.Open(ctx, store.Config{URL: cfg.Database.URL, Schema: cfg.Database.Schema, MaxConns: int32(cfg.Database.MaxConns),
		Citus: cfg.Database.Citus})
}

// citusUnsupported is what of cfg hipq does not run on Citus yet: rate
// limits (their counts are kept in a table that is not distributed). A
// store on Citus refuses to start with them rather than fail every claim.
func citusUnsupported(cfg *config.Config) error {
	for _, q := range cfg.Queues {
		if len(q.Rates) > 0 {
			return fmt.Errorf("queues.%s.rates: rate limits are not supported on Citus yet (database.citus): remove them, or run on one PostgreSQL", q.Name)
		}
	}
	for _, t := range cfg.JobTypes {
		if len(t.Rates) > 0 {
			return fmt.Errorf("job_types.%s.rates: rate limits are not supported on Citus yet (database.citus): remove them, or run on one PostgreSQL", t.Name)
		}
	}
	return nil
}

package main

import (
	"context"

	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/store"
)

func openStore(ctx context.Context, cfg *config.Config) (*store.Store, error) {
	return store.Open(ctx, store.Config{URL: cfg.Database.URL, Schema: cfg.Database.Schema, MaxConns: int32(cfg.Database.MaxConns),
		Citus: cfg.Database.Citus})
}

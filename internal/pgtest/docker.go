//go:build docker

package pgtest

import (
	"context"
	"fmt"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/postgres"
)

func init() {
	startContainer = func(ctx context.Context) (string, func(), error) {
		provider, err := testcontainers.ProviderDocker.GetProvider()
		if err == nil {
			err = provider.Health(ctx)
		}
		if err != nil {
			return "", nil, fmt.Errorf("%w: %v", errNoDocker, err)
		}
		c, err := postgres.Run(ctx, "postgres:16", postgres.WithUsername("hipq"), postgres.WithPassword("hipq"),
			postgres.WithDatabase("postgres"), postgres.BasicWaitStrategies())
		if err != nil {
			return "", nil, err
		}
		url, err := c.ConnectionString(ctx, "sslmode=disable")
		if err != nil {
			_ = testcontainers.TerminateContainer(c)
			return "", nil, err
		}
		return url, func() { _ = testcontainers.TerminateContainer(c) }, nil
	}
}

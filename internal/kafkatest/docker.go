//go:build docker

package kafkatest

import (
	"context"
	"fmt"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/kafka"
)

func init() {
	startContainer = func(ctx context.Context) ([]string, error) {
		provider, err := testcontainers.ProviderDocker.GetProvider()
		if err == nil {
			err = provider.Health(ctx)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %v", errNoDocker, err)
		}
		// Ryuk removes the container when the test binary exits.
		c, err := kafka.Run(ctx, "confluentinc/confluent-local:7.5.0", kafka.WithClusterID("hipq-test"))
		if err != nil {
			return nil, err
		}
		return c.Brokers(ctx)
	}
}

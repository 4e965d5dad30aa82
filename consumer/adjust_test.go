package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/localpg"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// franz-go asks the offsets hook not to outlast the rebalance timeout.
// With PostgreSQL down at assignment, the hook gives up within it, the
// client rejoins and asks again, and once PostgreSQL is back the records
// are applied from PostgreSQL's offsets: nothing is read from anywhere
// else meanwhile, and the group is never stuck in one endless hook.
func TestAdjustIsBoundedAndRetriedByRejoining(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, err := localpg.Start(ctx, localpg.Options{})
	if errors.Is(err, localpg.ErrNoServer) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Stop()
	st, err := store.Open(ctx, store.Config{URL: pg.URL("postgres"), MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	k := kafkatest.New(t)
	topic := k.Topic("adjust")
	k.CreateTopics(1, topic)
	k.Produce(&kgo.Record{Topic: topic, Value: []byte(`{"job_type":"t","job_key":"a","job_data":{}}`)})
	pg.Down()

	core, logs := observer.New(zapcore.WarnLevel)
	in, err := NewIntake(zap.New(core), st, IntakeConfig{GroupConfig: GroupConfig{Kafka: kafkaconn.Config{Brokers: k.Brokers},
		Group: topic + "-g", Topics: []string{topic}, SessionTimeout: 6 * time.Second}, MaxBytes: 4096,
		Types: correlator.Types{"t": {Name: "t", Queue: "default", Retry: correlator.NoRetry}}})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = in.Run(runCtx) }()
	defer func() { stop(); <-done }()

	defer func() {
		if t.Failed() {
			for _, e := range logs.All() {
				t.Log(e.Message, e.ContextMap())
			}
		}
	}()
	testutil.Eventually(t, time.Minute, func() bool {
		return logs.FilterMessage("cannot load stored offsets; rejoining the group to try again").Len() > 0
	}, "the offsets hook to give up while PostgreSQL is down")
	if err := pg.Up(ctx); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() bool {
		j, err := st.JobGet(ctx, "t", "a")
		return err == nil && j != nil
	}, "the record to be applied once PostgreSQL is back")
}

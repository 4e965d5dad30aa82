package consumer

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
)

// An intake record's hipq-reply-to is kept with its job when
// events.allowed_reply_to allows it, with the record's hipq-correlation-*
// headers; one no pattern allows is dead-lettered reply_to_not_allowed
// and makes no job.
func TestIntakeReplyTo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st := pgtest.New(t)
	k := kafkatest.New(t)
	in := k.Topic("jobs")
	k.CreateTopics(1, in)
	types := correlator.Types{"t": {Name: "t", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry,
		AllowedReplyTo: []string{"callers.*"}}}
	intake, err := NewIntake(zaptest.NewLogger(t), st, IntakeConfig{GroupConfig: GroupConfig{Kafka: kafkaconn.Config{Brokers: k.Brokers},
		Group: in + "-g", Topics: []string{in}}, MaxBytes: 4096, Types: types})
	if err != nil {
		t.Fatal(err)
	}
	k.Produce(
		&kgo.Record{Topic: in, Value: []byte(`{"job_type":"t","job_key":"ok"}`), Headers: []kgo.RecordHeader{
			{Key: correlator.HeaderReplyTo, Value: []byte("callers.billing")},
			{Key: "hipq-correlation-id", Value: []byte("c-42")},
			{Key: "other", Value: []byte("not copied")}}},
		&kgo.Record{Topic: in, Value: []byte(`{"job_type":"t","job_key":"bad"}`), Headers: []kgo.RecordHeader{
			{Key: correlator.HeaderReplyTo, Value: []byte("payments.requests")}}},
	)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = intake.Run(runCtx) }()
	defer func() { stop(); <-done }()
	testutil.Eventually(t, time.Minute, func() bool {
		var n int
		err := st.Pool().QueryRow(ctx, `SELECT (SELECT count(*) FROM hipq_job) + (SELECT count(*) FROM hipq_dead_letter)`).Scan(&n)
		return err == nil && n == 2
	}, "both records applied")
	j, err := st.JobGet(ctx, "t", "ok")
	if err != nil {
		t.Fatal(err)
	}
	if j.ReplyTo != "callers.billing" {
		t.Errorf("reply_to %q, want callers.billing", j.ReplyTo)
	}
	var corr string
	if err := st.Pool().QueryRow(ctx, `SELECT correlation::text FROM hipq_job WHERE job_key = 'ok'`).Scan(&corr); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(corr, `"hipq-correlation-id"`) || strings.Contains(corr, "other") {
		t.Errorf("correlation %s, want the hipq-correlation-id header only", corr)
	}
	if _, err := st.JobGet(ctx, "t", "bad"); err != correlator.ErrNotFound {
		t.Errorf("a job for a reply_to not allowed: %v", err)
	}
	var reason string
	if err := st.Pool().QueryRow(ctx, `SELECT reason FROM hipq_dead_letter`).Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(reason, correlator.CodeReplyToNotAllowed+": ") || !strings.Contains(reason, "payments.requests") {
		t.Errorf("dead letter reason %q, want %s naming the topic", reason, correlator.CodeReplyToNotAllowed)
	}
}

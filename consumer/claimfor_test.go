package consumer

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// With this instance's dispatcher as its claimer, the intake stores due
// jobs claimed, and the dispatcher sends them: no claim of the table, no
// waiting row. The requests reach their topic and their sends are
// recorded though the dispatcher never ran a claim round.
func TestIntakeClaimsForItsDispatcher(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	ctx := context.Background()
	st := pgtest.New(t)
	k := kafkatest.New(t)
	in, out := k.Topic("jobs"), k.Topic("requests")
	k.CreateTopics(1, in, out)
	types := correlator.Types{"t": {Name: "t", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}
	pc := k.Client(dispatcher.KafkaProducerOpts()...)
	t.Cleanup(pc.Close)
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "me", Queues: []dispatcher.QueueConfig{{Name: "default"}},
		Types: types, Senders: map[string]dispatcher.Sender{"t": dispatcher.NewKafkaSender(pc, map[string]dispatcher.KafkaRoute{"t": {Topic: out}})}})
	intake, err := NewIntake(zaptest.NewLogger(t), st, IntakeConfig{GroupConfig: GroupConfig{Kafka: kafkaconn.Config{Brokers: k.Brokers},
		Group: in + "-g", Topics: []string{in}}, MaxBytes: 4096, Types: types})
	if err != nil {
		t.Fatal(err)
	}
	intake.ClaimFor(claimsOf(d), "me")
	const n = 20
	for i := range n {
		k.Produce(&kgo.Record{Topic: in, Value: fmt.Appendf(nil, `{"job_type":"t","job_key":"k%d","job_data":{"i":%d}}`, i, i)})
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = intake.Run(runCtx) }()
	defer func() { stop(); <-done }()
	testutil.Eventually(t, time.Minute, func() bool {
		var sent int
		err := st.Pool().QueryRow(ctx, `SELECT count(*) FROM hipq_job j JOIN hipq_attempt a ON a.queue = j.queue AND a.job_id = j.id AND a.attempt = j.attempt
			WHERE j.state = 'running' AND a.instance = 'me' AND a.sent_at IS NOT NULL`).Scan(&sent)
		return err == nil && sent == n
	}, "every job sent and recorded")
	cl := k.Client(kgo.ConsumeTopics(out), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer cl.Close()
	got := 0
	for got < n {
		pollCtx, cancel := context.WithTimeout(ctx, time.Minute)
		fs := cl.PollFetches(pollCtx)
		cancel()
		if err := fs.Err0(); err != nil {
			t.Fatalf("read the requests: %v (%d of %d)", err, got, n)
		}
		got += fs.NumRecords()
	}
}

type nowhere struct{}

func (nowhere) Send(context.Context, []store.Claimed) []dispatcher.Result { return nil }
func (nowhere) Transport() string                                         { return "none" }
func (nowhere) Route(string) dispatcher.Route                             { return dispatcher.Route{Neighbour: "none"} }

// When the room is short of a batch's jobs, it goes to those the
// dispatcher would claim first in their queue's order; jobs not due, past
// their expiry or with windows of their own take none of it.
func TestIntakeRoomGoesInQueueOrder(t *testing.T) {
	t.Parallel()
	types := correlator.Types{"t": {Name: "t", Queue: "default", Retry: correlator.NoRetry}}
	d := dispatcher.New(zaptest.NewLogger(t), pgtest.New(t), dispatcher.Config{Instance: "me", BatchSize: 2,
		Queues: []dispatcher.QueueConfig{{Name: "default", Order: correlator.OrderPriorityFirst}}, Types: types,
		Senders: map[string]dispatcher.Sender{"t": nowhere{}}})
	in := &Intake{}
	in.ClaimFor(claimsOf(d), "me")
	past := time.Now().Add(-time.Minute)
	mk := func(key string, prio int, f func(*correlator.Job)) store.IntakeJob {
		j := &correlator.Job{Queue: "default", JobType: "t", JobKey: key, Priority: prio}
		if f != nil {
			f(j)
		}
		return store.IntakeJob{Job: j}
	}
	jobs := []store.IntakeJob{
		mk("low", 100, nil),
		mk("later", 1, func(j *correlator.Job) { j.ScheduledRunTime = time.Now().Add(time.Hour) }),
		mk("expired", 1, func(j *correlator.Job) { j.ExpiresAt = &past }),
		mk("windowed", 1, func(j *correlator.Job) { j.TimeWindows = []correlator.TimeWindow{{Start: "00:00", End: "23:59"}} }),
		mk("high", 1, nil),
		mk("mid", 50, nil),
	}
	rs := in.reserve(jobs)
	var claimed []string
	for _, ij := range jobs {
		if ij.Claim {
			claimed = append(claimed, ij.Job.JobKey)
		}
	}
	if len(rs) != 1 || !slices.Equal(claimed, []string{"high", "mid"}) {
		t.Fatalf("claimed %v, want the two first in priority order of those due", claimed)
	}
	rs["default"].Release()
}

// claimsOf hands d's reservations to the intake, as cmd/hipq wires them.
func claimsOf(d *dispatcher.Dispatcher) Claimer {
	return ClaimerFunc(func(queue string, jobTypes []string) Reservation {
		if r := d.Reserve(queue, jobTypes); r != nil {
			return r
		}
		return nil // (never a nil *dispatcher.Reservation in the interface)
	})
}

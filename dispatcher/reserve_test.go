package dispatcher_test

import (
	"context"
	"slices"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// The intake claims due jobs as it stores them only under room the
// dispatcher reserved: never more than MaxInFlight in all, under the
// queue's limits when it has some, only of types this instance sends with
// no time windows; given back on release. What it claimed is sent and recorded
// like any claim, and a dispatcher that is stopping reserves nothing.
func TestReserveBoundsTheIntakeClaims(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	st := pgtest.New(t)
	_, topic, cl := requestTopic(t)
	tys := types()
	tys["windowed"] = &correlator.JobType{Name: "windowed", Queue: "default", Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry,
		Windows: []correlator.TimeWindow{{Start: "00:00", End: "23:59"}}}
	tys["unsendable"] = &correlator.JobType{Name: "unsendable", Queue: "default", Retry: correlator.NoRetry}
	tys["limited"] = &correlator.JobType{Name: "limited", Queue: "held", Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}
	s := dispatcher.NewKafkaSender(cl, map[string]dispatcher.KafkaRoute{"alo": {Topic: topic}, "amo": {Topic: topic}, "windowed": {Topic: topic}})
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 100, MaxInFlight: 10,
		Queues: []dispatcher.QueueConfig{{Name: "default"}, {Name: "held", Throttle: correlator.Throttle{Limit: 5}}}, Types: tys,
		Senders: map[string]dispatcher.Sender{"alo": s, "amo": s, "windowed": s, "limited": s}})
	alo := func(n int) []string { return slices.Repeat([]string{"alo"}, n) }
	if d.Reserve("nowhere", alo(3)) != nil {
		t.Fatal("room reserved in a queue not served")
	}
	if h := d.Reserve("held", []string{"limited"}); h == nil || h.Limits().Throttle.Limit != 5 {
		t.Fatalf("reservation in a queue with limits: %+v, want its limits", h)
	} else {
		h.Release()
	}
	if d.Reserve("default", []string{"windowed", "unsendable"}) != nil {
		t.Fatal("room reserved for jobs of types it may not claim")
	}
	r := d.Reserve("default", append(alo(4), "windowed"))
	if r == nil || r.Room() != 4 || r.Limits().Throttle.Limit != 0 || !r.Takes("alo") || !r.Takes("amo") || r.Takes("windowed") || r.Takes("unsendable") {
		t.Fatalf("reservation %+v", r)
	}
	r2 := d.Reserve("default", alo(100))
	if r2 == nil || r2.Room() != 6 {
		t.Fatalf("second reservation: %+v, want the 6 left of 10", r2)
	}
	if d.Reserve("default", alo(1)) != nil {
		t.Fatal("room reserved past MaxInFlight")
	}
	r2.Release()
	r2.Release() // (twice: nothing more)
	// The reserved jobs, claimed as they are stored, are sent and recorded.
	b := store.IntakeBatch{Group: "g", Offsets: []store.OffsetAdvance{{Topic: "in", Partition: 0, From: -1, To: 3}}, Instance: "test",
		Limits: map[string]store.IntakeLimits{"default": r.Limits()}}
	for _, k := range []string{"a", "b", "c"} {
		b.Jobs = append(b.Jobs, store.IntakeJob{Claim: true, Source: store.Source{Topic: "in", Value: []byte(k)}, Job: &correlator.Job{
			Queue: "default", JobType: "alo", JobKey: k, JobData: []byte(`{}`), MaxAttempts: 1, Priority: 100, ThrottleFactor: 1,
			TimeoutSeconds: 3600}})
	}
	res, err := st.IntakeApply(ctx, b)
	if err != nil || len(res.Claimed) != 3 {
		t.Fatalf("claimed %d of 3: %v", len(res.Claimed), err)
	}
	r.Deliver(ctx, res.Claimed)
	if _, err := d.RunOnce(ctx); err != nil { // (waits for every delivery)
		t.Fatal(err)
	}
	if n := scalar(t, st, `SELECT count(*) FROM hipq_attempt WHERE instance = 'test' AND sent_at IS NOT NULL`); n != 3 {
		t.Fatalf("%d of 3 jobs claimed at intake sent and recorded", n)
	}
	if r := d.Reserve("default", alo(100)); r == nil || r.Room() != 10 {
		t.Fatalf("room after the deliveries: %+v, want all 10 back", r)
	} else {
		r.Release()
	}
	// A dispatcher that is stopping reserves nothing (its drain would not
	// wait for what a late reservation claims).
	stopped, cancel := context.WithCancel(ctx)
	cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(stopped) }()
	select {
	case _ = <-done:
	case <-time.After(time.Minute):
		t.Fatal("Run did not stop")
	}
	if d.Reserve("default", alo(1)) != nil {
		t.Fatal("a stopped dispatcher reserved room")
	}
}

// A reservation holds at most a batch of room, so the dispatcher's own
// claims find room beside the intake's; and jobs claimed at intake whose
// batch took longer than IntakeClaimsFor to store are undone, never
// sent (the rescue of unsent claims draws near).
func TestReservationsAreBoundedAndFresh(t *testing.T) {
	pgtest.SkipOnCitus(t, "no job is claimed as it is stored: jobs wait for their dispatchers' claims")
	t.Parallel()
	st := pgtest.New(t)
	_, topic, cl := requestTopic(t)
	s := dispatcher.NewKafkaSender(cl, map[string]dispatcher.KafkaRoute{"alo": {Topic: topic}})
	m := metrics.New()
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 3, MaxInFlight: 100, Metrics: m,
		Queues: []dispatcher.QueueConfig{{Name: "default"}}, Types: types(), Senders: map[string]dispatcher.Sender{"alo": s}})
	r := d.Reserve("default", slices.Repeat([]string{"alo"}, 50))
	if r == nil || r.Room() != 3 {
		t.Fatalf("reservation %+v, want a batch (3)", r)
	}
	b := store.IntakeBatch{Group: "g", Offsets: []store.OffsetAdvance{{Topic: "in", Partition: 0, From: -1, To: 2}}, Instance: "test",
		Limits: map[string]store.IntakeLimits{"default": r.Limits()}}
	for _, k := range []string{"stale", "fresh"} {
		b.Jobs = append(b.Jobs, store.IntakeJob{Claim: true, Source: store.Source{Topic: "in", Value: []byte(k)}, Job: &correlator.Job{
			Queue: "default", JobType: "alo", JobKey: k, JobData: []byte(`{}`), MaxAttempts: 1, Priority: 100, ThrottleFactor: 1,
			TimeoutSeconds: 3600}})
	}
	res, err := st.IntakeApply(ctx, b)
	if err != nil || len(res.Claimed) != 2 {
		t.Fatalf("claimed %d of 2: %v", len(res.Claimed), err)
	}
	claims := map[string]time.Time{}
	for i := range res.Claimed {
		c := &res.Claimed[i]
		claims[c.JobKey] = c.StartedAt
		if c.JobKey == "stale" {
			c.ClaimedLocal = time.Now().Add(-dispatcher.DefaultIntakeClaimsFor - time.Second)
		}
	}
	r.Deliver(ctx, res.Claimed)
	// The stale claim is undone, the fresh one sent (no claim round runs
	// here: the undone job stays waiting).
	testutil.Eventually(t, 30*time.Second, func() bool {
		return scalar(t, st, `SELECT count(*) FROM hipq_attempt WHERE sent_at IS NOT NULL`) == 1 &&
			scalar(t, st, `SELECT count(*) FROM hipq_job WHERE job_key = 'stale' AND state = 'initial'`) == 1
	}, "the fresh claim sent and the stale one undone")
	if j, err := st.JobGet(ctx, "alo", "fresh"); err != nil || j.State != correlator.StateRunning || !j.StartedAt.Equal(claims["fresh"]) {
		t.Fatalf("fresh: %+v %v, want the intake's claim running", j, err)
	}
	if j, err := st.JobGet(ctx, "alo", "stale"); err != nil || j.StartedAt != nil && j.StartedAt.Equal(claims["stale"]) {
		t.Fatalf("stale: %+v %v, want the intake's claim undone", j, err)
	}
	if n := scalar(t, st, `SELECT count(*) FROM hipq_attempt WHERE sent_at IS NOT NULL`); n != 1 {
		t.Fatalf("%d attempts sent, want the fresh one", n)
	}
	if n := promtestutil.ToFloat64(m.Dispatches.WithLabelValues("default", "kafka", "not_sent")); n != 1 {
		t.Fatalf("hipq_dispatches_total{status=not_sent} = %v, want the stale claim", n)
	}
}

// gate holds every send until it is opened, and says when it holds some.
type gate struct {
	held chan struct{}
	open chan struct{}
}

func (g *gate) Transport() string             { return "stub" }
func (g *gate) Route(string) dispatcher.Route { return dispatcher.Route{Neighbour: "stub"} }
func (g *gate) Send(_ context.Context, jobs []store.Claimed) []dispatcher.Result {
	select {
	case g.held <- struct{}{}:
	default:
	}
	<-g.open
	return make([]dispatcher.Result, len(jobs)) // (Sent)
}

// While the dispatcher's last round claimed a full batch (a backlog: due
// jobs waiting, which come first), the intake reserves no room in that
// queue, though room is free.
func TestNoReservationBesideABacklog(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	g := &gate{held: make(chan struct{}, 1), open: make(chan struct{})}
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 5, MaxInFlight: 5,
		Queues: []dispatcher.QueueConfig{{Name: "default"}}, Types: types(), Senders: map[string]dispatcher.Sender{"alo": g}})
	insert(t, st, "alo", 12)
	done := make(chan error, 1)
	go func() { _, err := d.RunOnce(ctx); done <- err }()
	select {
	case <-g.held: // a full batch claimed, its sends held: no room for another round
	case <-time.After(time.Minute):
		t.Fatal("nothing claimed")
	}
	close(g.open)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// The room is free again; 7 jobs are due.
	if r := d.Reserve("default", []string{"alo"}); r != nil {
		r.Release()
		t.Fatal("room reserved beside a backlog")
	}
	for { // the backlog drained
		n, err := d.RunOnce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
	}
	if r := d.Reserve("default", []string{"alo"}); r == nil {
		t.Fatal("no room reserved once the backlog drained")
	} else {
		r.Release()
	}
}

// In a queue with limits, while the dispatcher's last claim left due jobs
// waiting for room (the queue full: store.Claim.Held), the intake reserves
// no room there: those jobs come first. Once a claim finds room for all
// that is due, it does again.
func TestNoReservationWhileLimitsHoldJobs(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	g := &gate{held: make(chan struct{}, 1), open: make(chan struct{})}
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 50, MaxInFlight: 50,
		Queues: []dispatcher.QueueConfig{{Name: "default", Throttle: correlator.Throttle{Limit: 3}}}, Types: types(),
		Senders: map[string]dispatcher.Sender{"alo": g}})
	insert(t, st, "alo", 5)
	close(g.open)
	if n, err := d.RunOnce(ctx); err != nil || n != 3 {
		t.Fatalf("claimed %d (%v), want the limit, 3", n, err)
	}
	if r := d.Reserve("default", []string{"alo"}); r != nil {
		r.Release()
		t.Fatal("room reserved while the limit holds due jobs back")
	}
	// The three end; the next round claims the two left, and nothing is held.
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET state = 'final', outcome = 'succeeded', update_time = now() WHERE state = 'running'`); err != nil {
		t.Fatal(err)
	}
	if n, err := d.RunOnce(ctx); err != nil || n != 2 {
		t.Fatalf("claimed %d (%v), want the 2 left", n, err)
	}
	if r := d.Reserve("default", []string{"alo"}); r == nil {
		t.Fatal("no room reserved once the limit held nothing back")
	} else {
		r.Release()
	}
}

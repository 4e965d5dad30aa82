package dispatcher_test

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var ctx = context.Background()

func types() map[string]*correlator.JobType {
	return map[string]*correlator.JobType{
		"alo": {Name: "alo", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry},
		"amo": {Name: "amo", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtMostOnce, Retry: correlator.NoRetry},
	}
}

func insert(t *testing.T, st *store.Store, typ string, n int) {
	t.Helper()
	var jobs []*correlator.Job
	for i := range n {
		jobs = append(jobs, &correlator.Job{Queue: "default", JobType: typ, JobKey: typ + strconv.Itoa(i), JobData: json.RawMessage(`{}`),
			MaxAttempts: 1, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)})
	}
	if _, err := st.JobsInsert(ctx, jobs); err != nil {
		t.Fatal(err)
	}
}

func newDispatcher(t *testing.T, st *store.Store, cl *kgo.Client, topic string) (*dispatcher.Dispatcher, *metrics.Metrics) {
	routes := map[string]dispatcher.KafkaRoute{"alo": {Topic: topic, ReplyTopic: "replies"}, "amo": {Topic: topic, Envelope: true}}
	s := dispatcher.NewKafkaSender(cl, routes)
	m := metrics.New()
	return dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 100, Metrics: m,
		Queues: []dispatcher.QueueConfig{{Name: "default"}}, Types: types(), Senders: map[string]dispatcher.Sender{"alo": s, "amo": s}}), m
}

func scalar(t testing.TB, st *store.Store, q string) int {
	t.Helper()
	var n int
	if err := st.Pool().QueryRow(ctx, q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// requestTopic makes a Kafka cluster with a requests topic and a producer
// with the dispatcher's settings.
func requestTopic(t *testing.T) (*kafkatest.Cluster, string, *kgo.Client) {
	k := kafkatest.New(t)
	topic := k.Topic("requests")
	k.CreateTopics(1, topic)
	cl := k.Client(dispatcher.KafkaProducerOpts()...)
	t.Cleanup(cl.Close)
	return k, topic, cl
}

// Requests carry the §5 key, value and headers, and sent_at is recorded.
func TestSendKafka(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	k, topic, cl := requestTopic(t)
	insert(t, st, "alo", 3)
	insert(t, st, "amo", 1)
	insert(t, st, "unsendable", 2) // no transport on this instance: never claimed
	d, _ := newDispatcher(t, st, cl, topic)
	if n, err := d.RunOnce(ctx); err != nil || n != 4 {
		t.Fatalf("claimed %d, err %v", n, err)
	}
	if n := scalar(t, st, "SELECT count(*) FROM hipq_job WHERE job_type = 'unsendable' AND state = 'initial' AND attempt = 0"); n != 2 {
		t.Fatalf("jobs without a transport were claimed")
	}
	if n := scalar(t, st, "SELECT count(*) FROM hipq_attempt WHERE sent_at IS NOT NULL"); n != 4 {
		t.Fatalf("%d sends recorded, want 4", n)
	}
	rd := k.Client(kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer rd.Close()
	var recs []*kgo.Record
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for len(recs) < 4 {
		if pctx.Err() != nil {
			t.Fatalf("read %d requests, want 4", len(recs))
		}
		recs = append(recs, rd.PollFetches(pctx).Records()...)
	}
	for _, r := range recs {
		h := map[string]string{}
		for _, x := range r.Headers {
			h[x.Key] = string(x.Value)
		}
		if h["hipq-job-key"] != string(r.Key) || h["hipq-attempt"] != "1" || h["hipq-job-id"] == "" || h["hipq-job-type"] == "" {
			t.Errorf("headers %v key %s", h, r.Key)
		}
		switch h["hipq-job-type"] {
		case "alo":
			if string(r.Value) != "{}" || h["hipq-reply-to"] != "replies" {
				t.Errorf("plain request: value %s reply-to %q", r.Value, h["hipq-reply-to"])
			}
		case "amo":
			var env map[string]any
			if json.Unmarshal(r.Value, &env) != nil || env["job_key"] != "amo0" || env["attempt"] != 1.0 {
				t.Errorf("envelope %s", r.Value)
			}
		}
	}
}

// Invariant 8: while the broker refuses, claims are undone (no attempt is
// burned, for either delivery mode) and the dispatcher stops claiming.
func TestBrokerDownUndoesClaimsAndBacksOff(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	k := kafkatest.New(t)
	if k.Fake() == nil {
		t.Skip("needs kfake to take the broker down")
	}
	topic := k.Topic("requests")
	k.CreateTopics(1, topic)
	cl := k.Client(append(dispatcher.KafkaProducerOpts(), kgo.RecordDeliveryTimeout(time.Second), kgo.RequestTimeoutOverhead(500*time.Millisecond))...)
	defer cl.Close()
	insert(t, st, "alo", 5)
	insert(t, st, "amo", 5)
	k.Fake().Close()
	d, m := newDispatcher(t, st, cl, topic)
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	claimed := testutil.ToFloat64(m.Claimed.WithLabelValues("default"))
	unsent := testutil.ToFloat64(m.Dispatches.WithLabelValues("default", "kafka", "refused")) +
		testutil.ToFloat64(m.Dispatches.WithLabelValues("default", "kafka", "unknown"))
	if sent := testutil.ToFloat64(m.Dispatches.WithLabelValues("default", "kafka", "sent")); claimed != 10 || unsent != 10 || sent != 0 {
		t.Fatalf("metrics: %v claimed, %v refused or unknown, %v sent: want 10 claimed and not sent", claimed, unsent, sent)
	}
	if n := scalar(t, st, "SELECT count(*) FROM hipq_job WHERE state = 'initial' AND attempt = 0 AND error = 'NONE'"); n != 10 {
		t.Fatalf("%d jobs restored, want 10", n)
	}
	if n := scalar(t, st, "SELECT count(*) FROM hipq_attempt"); n != 0 {
		t.Fatalf("%d attempt rows left", n)
	}
	// Backing off: the next round claims nothing.
	if n, _ := d.RunOnce(ctx); n != 0 {
		t.Fatalf("claimed %d while the transport backs off", n)
	}
}

// A due job found outside its time windows is not sent: it moves to the
// next opening with no attempt used, or ends expired when that opening is
// past its expiry (SPEC §8).
func TestClosedWindowReschedulesOrExpires(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	_, topic, cl := requestTopic(t)
	now := time.Now().UTC()
	closed := []correlator.TimeWindow{{Start: now.Add(2 * time.Hour).Format("15:04"), End: now.Add(3 * time.Hour).Format("15:04")}}
	soon := now.Add(time.Hour)
	later := now.Add(5 * time.Hour)
	mk := func(key string, expires *time.Time) *correlator.Job {
		return &correlator.Job{Queue: "default", JobType: "alo", JobKey: key, JobData: json.RawMessage(`{}`), MaxAttempts: 1,
			Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: now.Add(-time.Minute),
			TimeWindows: closed, ExpiresAt: expires}
	}
	if _, err := st.JobsInsert(ctx, []*correlator.Job{mk("waits", &later), mk("expires", &soon)}); err != nil {
		t.Fatal(err)
	}
	d, m := newDispatcher(t, st, cl, topic)
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	claimed := testutil.ToFloat64(m.Claimed.WithLabelValues("default"))
	deferred := testutil.ToFloat64(m.Deferred.WithLabelValues("default", "deferred"))
	if expired := testutil.ToFloat64(m.Deferred.WithLabelValues("default", "expired")); claimed != 0 || deferred != 1 || expired != 1 {
		t.Fatalf("metrics: %v claimed, %v deferred, %v expired: want 1 deferred, 1 expired, none claimed", claimed, deferred, expired)
	}
	j, err := st.JobGet(ctx, "alo", "waits")
	if err != nil {
		t.Fatal(err)
	}
	if j.State != correlator.StateInitial || j.Attempt != 0 || j.ScheduledRunTime.Sub(now) < time.Hour+58*time.Minute {
		t.Fatalf("waiting job: state %s attempt %d scheduled %v, want initial, 0, at the opening in ~2h", j.State, j.Attempt, j.ScheduledRunTime)
	}
	j, err = st.JobGet(ctx, "alo", "expires")
	if err != nil {
		t.Fatal(err)
	}
	if j.Outcome != correlator.OutcomeExpired || j.Attempt != 0 {
		t.Fatalf("expiring job: outcome %s attempt %d, want expired without an attempt", j.Outcome, j.Attempt)
	}
	if n := scalar(t, st, "SELECT count(*) FROM hipq_attempt"); n != 0 {
		t.Fatalf("%d attempt rows: a closed job was sent", n)
	}
}

// A round finds nothing due, and asks for no claim, unless a job of a type
// sent here is due (future jobs and other types' do not count). After a
// full batch (more may be due) the claim is asked at once. In a queue with
// a limit of its own, where a claim often finds nothing while jobs wait
// for a slot, no probe is made.
func TestNoClaimWithoutDueJobs(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	_, topic, cl := requestTopic(t)
	d, m := newDispatcher(t, st, cl, topic)
	rounds := func(result string) float64 {
		return testutil.ToFloat64(m.ClaimRounds.WithLabelValues("default", result))
	}
	if _, err := st.JobsInsert(ctx, []*correlator.Job{{Queue: "default", JobType: "alo", JobKey: "later", JobData: json.RawMessage(`{}`),
		MaxAttempts: 1, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(time.Hour)}}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if n, err := d.RunOnce(ctx); err != nil || n != 0 {
			t.Fatalf("claimed %d, err %v", n, err)
		}
	}
	if rounds("nothing_due") != 3 || rounds("empty")+rounds("claimed") != 0 {
		t.Fatalf("rounds: %v nothing due, %v empty, %v claimed; want 3 claims not asked", rounds("nothing_due"), rounds("empty"), rounds("claimed"))
	}
	insert(t, st, "unsendable", 1) // due, but not sent here
	insert(t, st, "alo", 150)
	if n, err := d.RunOnce(ctx); err != nil || n != 150 {
		t.Fatalf("claimed %d, err %v", n, err)
	}
	// A full batch of 100, then (more may be due) a claim without a probe
	// for the other 50. The next round finds nothing due of its types.
	if n, err := d.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("claimed %d, err %v", n, err)
	}
	if rounds("claimed") != 2 || rounds("empty") != 0 || rounds("nothing_due") != 4 {
		t.Fatalf("rounds: %v claimed, %v empty, %v nothing due; want 2, 0, 4", rounds("claimed"), rounds("empty"), rounds("nothing_due"))
	}

	// With limits too: a probe, and no claim lock taken, while nothing is
	// due; once the limit holds due jobs back, the claim is asked without
	// a probe until it holds none.
	routes := map[string]dispatcher.KafkaRoute{"alo": {Topic: topic}}
	s := dispatcher.NewKafkaSender(cl, routes)
	lm := metrics.New()
	ld := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 100, Metrics: lm,
		Queues: []dispatcher.QueueConfig{{Name: "default", Throttle: correlator.Throttle{Limit: 151}}}, Types: types(),
		Senders: map[string]dispatcher.Sender{"alo": s}})
	lrounds := func(result string) float64 {
		return testutil.ToFloat64(lm.ClaimRounds.WithLabelValues("default", result))
	}
	if n, err := ld.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("claimed %d, err %v", n, err)
	}
	if lrounds("empty") != 0 || lrounds("nothing_due") != 1 {
		t.Fatalf("a throttled queue: %v empty claims, %v rounds with nothing due; want 0, 1", lrounds("empty"), lrounds("nothing_due"))
	}
	insertIn(t, st, "default", "alo", "more", 3) // (150 running: room for one)
	for _, want := range []int{1, 0} {
		if n, err := ld.RunOnce(ctx); err != nil || n != want {
			t.Fatalf("claimed %d, err %v; want %d", n, err, want)
		}
	}
	if lrounds("claimed") != 1 || lrounds("empty") != 1 || lrounds("nothing_due") != 1 {
		t.Fatalf("a throttled queue holding jobs back: %v claimed, %v empty, %v nothing due; want 1, 1, 1",
			lrounds("claimed"), lrounds("empty"), lrounds("nothing_due"))
	}
}

// cappedSender acknowledges every send; its type has a cap of its own in
// flight.
type cappedSender struct{ max int }

func (s cappedSender) Send(_ context.Context, jobs []store.Claimed) []dispatcher.Result {
	return make([]dispatcher.Result, len(jobs)) // (all Sent)
}
func (cappedSender) Transport() string { return "kafka" }
func (s cappedSender) Route(string) dispatcher.Route {
	return dispatcher.Route{Neighbour: "capped", Timeout: time.Minute, MaxInFlight: s.max}
}

// The probe covers the types capped on their own: where only such a type
// has jobs due, the round claims them (as many as its room).
func TestProbeCoversCappedTypes(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, "alo", 5)
	m := metrics.New()
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 100, Metrics: m,
		Queues: []dispatcher.QueueConfig{{Name: "default"}}, Types: types(),
		Senders: map[string]dispatcher.Sender{"alo": cappedSender{max: 3}}})
	if n, err := d.RunOnce(ctx); err != nil || n != 3 {
		t.Fatalf("claimed %d, err %v; want the 3 the cap lets in flight", n, err)
	}
	if c := testutil.ToFloat64(m.ClaimRounds.WithLabelValues("default", "claimed")); c != 1 {
		t.Fatalf("%v rounds claimed, want 1", c)
	}
	if n, err := d.RunOnce(ctx); err != nil || n != 2 {
		t.Fatalf("claimed %d, err %v; want the other 2", n, err)
	}
}

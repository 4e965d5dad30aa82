package dispatcher_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// slowHost answers every call only when released, and keeps the most
// calls it held at once.
type slowHost struct {
	*httptest.Server
	release chan struct{}
	once    sync.Once
	mu      sync.Mutex
	now     int
	peak    int
}

func newSlowHost(t testing.TB) *slowHost {
	h := &slowHost{release: make(chan struct{})}
	h.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.mu.Lock()
		h.now++
		h.peak = max(h.peak, h.now)
		h.mu.Unlock()
		select {
		case <-h.release:
		case <-r.Context().Done():
		}
		h.mu.Lock()
		h.now--
		h.mu.Unlock()
		w.WriteHeader(http.StatusAccepted)
	}))
	t.Cleanup(func() {
		h.free()
		h.Close()
	})
	return h
}

func (h *slowHost) free() { h.once.Do(func() { close(h.release) }) }

func (h *slowHost) peakCalls() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.peak
}

func insertIn(t testing.TB, st *store.Store, queue, typ, prefix string, n int) {
	t.Helper()
	var jobs []*correlator.Job
	for i := range n {
		jobs = append(jobs, &correlator.Job{Queue: queue, JobType: typ, JobKey: prefix + strconv.Itoa(i), JobData: json.RawMessage(`{}`),
			MaxAttempts: 2, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)})
	}
	if _, err := st.JobsInsert(ctx, jobs); err != nil {
		t.Fatal(err)
	}
}

// rig is a dispatcher with a healthy Kafka type "good" (queue healthy)
// beside, in queue others, a topic that refuses every produce ("lost": it
// does not exist on a cluster that creates none), a host that refuses
// connections ("gone") and a host that answers only when released
// ("slow", max_in_flight 2).
type rig struct {
	st   *store.Store
	d    *dispatcher.Dispatcher
	m    *metrics.Metrics
	slow *slowHost
	gone string
}

func newRig(t testing.TB) *rig {
	st := pgtest.New(t)
	fake, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.DefaultNumPartitions(1), kfake.SeedTopics(1, "good"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fake.Close)
	cl, err := kgo.NewClient(append(dispatcher.KafkaProducerOpts(), kgo.SeedBrokers(fake.ListenAddrs()...),
		kgo.MetadataMinAge(50*time.Millisecond), kgo.UnknownTopicRetries(1), kgo.RecordDeliveryTimeout(time.Second))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	ks := dispatcher.NewKafkaSender(cl, map[string]dispatcher.KafkaRoute{"good": {Topic: "good"}, "lost": {Topic: "missing"}})
	ks.SendTimeout = time.Second
	r := &rig{st: st, slow: newSlowHost(t), m: metrics.New()}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r.gone = "http://" + l.Addr().String()
	l.Close()
	hs := dispatcher.NewHTTPSender(dispatcher.HTTPSenderConfig{Routes: map[string]dispatcher.HTTPRoute{
		"slow": {URL: r.slow.URL + "/{job_key}", Timeout: time.Minute, MaxInFlight: 2},
		"gone": {URL: r.gone + "/{job_key}", Timeout: 300 * time.Millisecond},
	}})
	retry := &correlator.Backoff{Attempts: 2, Initial: time.Hour, When: []correlator.AttemptOutcome{correlator.AttemptDispatchError}}
	types := map[string]*correlator.JobType{}
	for _, n := range []string{"good", "lost", "slow", "gone"} {
		q := "others"
		if n == "good" {
			q = "healthy"
		}
		types[n] = &correlator.JobType{Name: n, Queue: q, Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: retry}
	}
	r.d = dispatcher.New(zap.NewNop(), st, dispatcher.Config{Instance: "test", BatchSize: 500, Interval: 50 * time.Millisecond,
		Queues: []dispatcher.QueueConfig{{Name: "others"}, {Name: "healthy"}}, Types: types, Metrics: r.m,
		Senders: map[string]dispatcher.Sender{"good": ks, "lost": ks, "slow": hs, "gone": hs}})
	return r
}

// run runs the dispatcher until the test ends.
func (r *rig) run(t testing.TB) {
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- r.d.Run(rctx) }()
	t.Cleanup(func() {
		cancel()
		r.slow.free()
		_ = <-done
	})
}

func (r *rig) sentGood(t testing.TB) int {
	return scalar(t, r.st, `SELECT count(*) FROM hipq_attempt a JOIN hipq_job j ON j.queue = a.queue AND j.id = a.job_id
		WHERE j.job_type = 'good' AND a.sent_at IS NOT NULL`)
}

// Issue 9.11: one topic that refuses every produce (it does not exist on
// a cluster that creates none), one host that refuses connections and one
// host that answers slowly each hold back their own job types only. The
// refusing ones are undone, not counted, and backed off apart, until their
// refusal outlasts the send timeout: then each attempt ends as a dispatch
// error naming the topic or host. The slow host never has more calls than
// its type's max_in_flight. Meanwhile a healthy type's jobs keep flowing,
// none of them undone.
func TestOneNeighbourHoldsOnlyItsOwn(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	st, d, m := r.st, r.d, r.m
	insertIn(t, st, "others", "lost", "l", 5)
	insertIn(t, st, "others", "gone", "g", 5)
	insertIn(t, st, "others", "slow", "s", 10)
	insertIn(t, st, "healthy", "good", "a", 20)
	r.run(t)
	testutil.Eventually(t, 30*time.Second, func() bool { return r.sentGood(t) == 20 }, "the first healthy jobs")
	// Both refusing neighbours refuse: their claims are undone and their
	// attempts not counted while the refusal is young.
	testutil.Eventually(t, 30*time.Second, func() bool {
		v, _ := m.Value("hipq_dispatches_total", map[string]string{"queue": "others", "transport": "http", "result": "refused"})
		w, _ := m.Value("hipq_dispatches_total", map[string]string{"queue": "others", "transport": "kafka", "result": "refused"})
		return v > 0 && w > 0
	}, "refusals")
	insertIn(t, st, "healthy", "good", "b", 20)
	d.Wake()
	testutil.Eventually(t, 30*time.Second, func() bool { return r.sentGood(t) == 40 }, "the healthy jobs enqueued during the outages")
	for _, res := range []string{"refused", "not_sent", "unknown", "failed"} {
		if v, _ := m.Value("hipq_dispatches_total", map[string]string{"queue": "healthy", "result": res}); v != 0 {
			t.Fatalf("%v healthy sends %s", v, res)
		}
	}
	if n := scalar(t, st, `SELECT count(*) FROM hipq_attempt a JOIN hipq_job j ON j.queue = a.queue AND j.id = a.job_id WHERE j.job_type = 'good'`); n != 40 {
		t.Fatalf("%d attempts of healthy jobs, want 40 (one each)", n)
	}
	// Outlasting the send timeout, the refusals become dispatch errors
	// that name where the requests were to go.
	for typ, where := range map[string]string{"lost": "kafka topic missing", "gone": "http " + r.gone} {
		testutil.Eventually(t, 30*time.Second, func() bool {
			return scalar(t, st, fmt.Sprintf(`SELECT count(*) FROM hipq_attempt a JOIN hipq_job j ON j.queue = a.queue AND j.id = a.job_id
				WHERE j.job_type = '%s' AND a.outcome = 'dispatch_error' AND a.error LIKE '%s has refused every send for %%'
				AND a.sent_at IS NULL`, typ, where)) > 0
		}, "%s's dispatch errors", typ)
	}
	if p := r.slow.peakCalls(); p != 2 {
		t.Fatalf("the slow host had %d calls at once, want its type's max_in_flight 2", p)
	}
}

// BenchmarkNeighbourIsolation sends a healthy type's jobs alone, then
// beside a refusing topic, a refusing host and a slow host with work
// pending: jobs/s of the healthy type should be about the same (issue 9.11
// asks within 10%).
func BenchmarkNeighbourIsolation(b *testing.B) {
	for _, faults := range []bool{false, true} {
		b.Run(map[bool]string{false: "alone", true: "beside-faults"}[faults], func(b *testing.B) {
			r := newRig(b)
			if faults {
				insertIn(b, r.st, "others", "lost", "l", 500)
				insertIn(b, r.st, "others", "gone", "g", 500)
				insertIn(b, r.st, "others", "slow", "s", 500)
			}
			n := max(b.N, 2000)
			insertIn(b, r.st, "healthy", "good", "a", n)
			b.ResetTimer()
			start := time.Now()
			r.run(b)
			deadline := time.Now().Add(5 * time.Minute)
			for r.sentGood(b) < n && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			b.ReportMetric(float64(n)/time.Since(start).Seconds(), "jobs/s")
		})
	}
}

package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/internal/citustest"
	"github.com/hipq/hipq/internal/testutil"
)

// arrivals is an HTTP downstream that notes when each request arrives.
type arrivals struct {
	mu sync.Mutex
	at map[string][]time.Time // by path
}

func newArrivals(t *testing.T) (*arrivals, *httptest.Server) {
	a := &arrivals{at: map[string][]time.Time{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		a.mu.Lock()
		a.at[r.URL.Path] = append(a.at[r.URL.Path], now)
		a.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"status":"succeeded"}`)
	}))
	t.Cleanup(srv.Close)
	return a, srv
}

func (a *arrivals) of(path string) []time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := append([]time.Time(nil), a.at[path]...)
	sort.Slice(out, func(i, j int) bool { return out[i].Before(out[j]) })
	return out
}

// mostInWindow is the largest number of times in any interval [t, t+w).
func mostInWindow(ts []time.Time, w time.Duration) int {
	most := 0
	for i := range ts {
		n := 0
		for j := i; j < len(ts) && ts[j].Sub(ts[i]) < w; j++ {
			n++
		}
		most = max(most, n)
	}
	return most
}

const rateConfig = `
name: rates
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"]}
intake: {topics: ["{{T:jobs}}"]}
dispatch: {interval: 1s}
sweeper: {schedule: "@every 1s"}
queues:
  - name: limited
    rates: [{limit: 5, period: 2s}]
  - name: tenants
    rates: [{limit: 2, period: 1s, by: {json: /tenant}}]
job_types:
  - {name: ping, queue: limited, transport: {http: {url: "URL/ping", mode: sync, timeout: 2s}}, timeout: 30s}
  - {name: work, queue: tenants, transport: {http: {url: "URL/work/{job_key}", mode: sync, timeout: 2s}}, timeout: 30s}
`

// A limit of 5 per 2 s on three instances, 30 jobs: no 2 s window of the
// downstream's arrival times holds more than 5, and the jobs still flow
// (the dispatchers wake when a window frees, not only at their 1 s poll).
func TestRateLimitAcrossInstances(t *testing.T) {
	down, srv := newArrivals(t)
	e := newEnv(t, "jobs")
	text := strings.ReplaceAll(rateConfig, "URL", srv.URL)
	for range 3 {
		e.start(e.config(text), "intake", "dispatcher", "sweeper")
	}
	var jobs []string
	for i := range 30 {
		jobs = append(jobs, fmt.Sprintf(`{"job_type":"ping","job_key":"p%02d"}`, i))
	}
	e.produce("jobs", jobs...)
	testutil.Eventually(t, 40*time.Second, func() (bool, string) {
		n := len(down.of("/ping"))
		return n >= 30, fmt.Sprint(n)
	}, "30 arrivals")
	ts := down.of("/ping")
	if most := mostInWindow(ts, 2*time.Second); most > 5 {
		t.Errorf("%d requests arrived within 2 s; the limit is 5 per 2 s", most)
	}
	t.Logf("30 requests in %v", ts[len(ts)-1].Sub(ts[0]))
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		var n int
		if err := e.pool().QueryRow(context.Background(), "SELECT count(*) FROM hipq_job WHERE outcome = 'succeeded'").Scan(&n); err != nil {
			return false, err.Error()
		}
		return n == 30, fmt.Sprint(n)
	}, "30 jobs succeeded")
}

// Tenant A with 200 jobs and B with 5, each limited 2/s by /tenant: B's
// jobs are not stuck behind A's backlog; B is done in about 3 s.
func TestRateLimitPerTenant(t *testing.T) {
	down, srv := newArrivals(t)
	e := newEnv(t, "jobs")
	e.start(e.config(strings.ReplaceAll(rateConfig, "URL", srv.URL)), "intake", "dispatcher", "sweeper")
	var jobs []string
	for i := range 200 {
		jobs = append(jobs, fmt.Sprintf(`{"job_type":"work","job_key":"a%03d","job_data":{"tenant":"A"}}`, i))
	}
	for i := range 5 {
		jobs = append(jobs, fmt.Sprintf(`{"job_type":"work","job_key":"b%d","job_data":{"tenant":"B"}}`, i))
	}
	start := time.Now()
	e.produce("jobs", jobs...)
	bDone := func() []time.Time {
		var out []time.Time
		for i := range 5 {
			out = append(out, down.of(fmt.Sprintf("/work/b%d", i))...)
		}
		sort.Slice(out, func(i, j int) bool { return out[i].Before(out[j]) })
		return out
	}
	testutil.Eventually(t, 15*time.Second, func() (bool, string) {
		return len(bDone()) == 5, fmt.Sprint(len(bDone()))
	}, "B's 5 jobs sent")
	b := bDone()
	t.Logf("B done %v after the first of its jobs was sent, %v after the produce", b[4].Sub(b[0]), b[4].Sub(start))
	if b[4].Sub(b[0]) > 3500*time.Millisecond {
		t.Errorf("B's 5 jobs took %v from the first to the last, want about 2 s (2 per second)", b[4].Sub(b[0]))
	}
	if most := mostInWindow(b, time.Second); most > 2 {
		t.Errorf("%d of B's jobs arrived within 1 s; its limit is 2/s", most)
	}
	var a []time.Time
	for i := range 200 {
		a = append(a, down.of(fmt.Sprintf("/work/a%03d", i))...)
	}
	sort.Slice(a, func(i, j int) bool { return a[i].Before(a[j]) })
	if most := mostInWindow(a, time.Second); most > 2 {
		t.Errorf("%d of A's jobs arrived within 1 s; its limit is 2/s", most)
	}
}

// TestCitusRunsRates: on a Citus cluster hipq starts with rate limits and
// keeps them: a queue's jobs are sent within its rate, and its windows are
// counted on the queue's shard of hipq_rate_count, co-located with its
// jobs.
func TestCitusRunsRates(t *testing.T) {
	down, srv := newArrivals(t)
	e := newEnv(t, "jobs")
	e.dbURL = citustest.URL(t)
	a := e.start(e.config(strings.ReplaceAll(rateConfig, "URL", srv.URL)), "intake", "dispatcher")
	var jobs []string
	for i := range 8 {
		jobs = append(jobs, fmt.Sprintf(`{"job_type":"ping","job_key":"p%d"}`, i))
	}
	e.produce("jobs", jobs...)
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := len(down.of("/ping"))
		return n >= 8, fmt.Sprint(n)
	}, "8 arrivals")
	if most := mostInWindow(down.of("/ping"), 2*time.Second); most > 5 {
		t.Errorf("%d requests arrived within 2 s; the limit is 5 per 2 s", most)
	}
	var colocated bool
	if err := a.st.Pool().QueryRow(context.Background(), `SELECT column_to_column_name(c.logicalrelid, c.partkey) = 'queue'
		AND c.colocationid = j.colocationid FROM pg_dist_partition c, pg_dist_partition j
		WHERE c.logicalrelid = 'hipq_rate_count'::regclass AND j.logicalrelid = 'hipq_job'::regclass`).Scan(&colocated); err != nil || !colocated {
		t.Fatalf("hipq_rate_count distributed by queue with hipq_job: %v (%v)", colocated, err)
	}
}

// TestCitusRefusesAStartThatMovesATypeOffItsJobs: on Citus, where one
// non-final job per (type, key) holds within a queue, hipq refuses to
// start with a config that puts a type in another queue than its
// non-final jobs', naming the type, the queue and the count (as
// check-config --database does), rather than let the type's keys take a
// second job.
func TestCitusRefusesAStartThatMovesATypeOffItsJobs(t *testing.T) {
	e := newEnv(t, "jobs")
	e.dbURL = citustest.URL(t)
	text := func(queue string) string {
		return `
database: {url: "{{DB}}", migrate: true}
kafka: {brokers: ["{{BROKERS}}"]}
queues: [{name: old}, {name: new}]
job_types:
  - {name: a, queue: ` + queue + `, transport: {kafka: {topic: a}}}
`
	}
	ctx := context.Background()
	a, err := newApp(ctx, e.config(text("old")), zaptest.NewLogger(t), appOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.st.Pool().Exec(ctx, `INSERT INTO hipq_job (queue, job_type, job_key, state) VALUES ('old', 'a', 'k', 'initial')`); err != nil {
		t.Fatal(err)
	}
	a.close()
	_, err = newApp(ctx, e.config(text("new")), zaptest.NewLogger(t), appOptions{})
	if err == nil || !strings.Contains(err.Error(), `job_types[0].queue: "new", but 1 non-final job of type a is in queue "old"`) {
		t.Fatalf("start with type a moved off its job's queue on Citus: %v, want the refusal naming it", err)
	}
}

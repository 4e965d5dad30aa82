package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
)

// anyNodeConfig is eventsConfig with a second job type in a queue of its
// own whose throttle allows 3 running jobs across every instance.
func anyNodeConfig() string {
	return strings.Replace(eventsConfig(), "job_types:", `queues:
  - {name: slow, throttle_limit: 3}
job_types:
  - name: slow
    queue: slow
    transport: {kafka: {topic: "{{T:requests}}"}}
    reply_topic: "{{T:replies}}"
    timeout: 2s
    retry: {max_attempts: 3, backoff: fixed, initial: 200ms, jitter: 0}`, 1)
}

// Two instances with every role, one connected to the Citus coordinator
// and one to a worker, share the work with every guarantee: each record
// is one job, each job ends once (succeeded, after the retries its
// replies and silences ask for), both instances claim, a throttled
// queue never runs more than its limit across both (the claim lock is a
// row on the queue's shard, not a per-node advisory lock), one relay
// sends each job's outcome events in the order they happened though the
// two nodes number them from separate ranges, and the roles of one
// instance at a time hold their lease of hipq_lock.
func TestInstancesOnCoordinatorAndWorkerShareTheWork(t *testing.T) {
	if !pgtest.OnCitus() {
		t.Skip("instances on a Citus cluster's nodes: make test-citus runs it")
	}
	t.Parallel()
	e := newEnv(t, eventsTopics...)
	text := anyNodeConfig()
	onCoordinator := e.config(text)
	workerURL := pgtest.WorkerURL(t, e.dbURL)
	onWorker := e.config(strings.Replace(text, "{{DB}}", workerURL, 1))
	if onWorker.Database.URL == onCoordinator.Database.URL {
		t.Fatal("both instances on one node")
	}
	a := e.start(onCoordinator)
	b := e.start(onWorker)
	if !a.st.Distributed() || !b.st.Distributed() {
		t.Fatal("an instance does not know it runs on Citus")
	}
	db := a.st.Pool()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.respondAfter(ctx, "requests", "replies", func() time.Duration { return 30 * time.Millisecond },
		func(key string, attempt int) (string, bool) {
			switch {
			case strings.HasPrefix(key, "fail-") && attempt == 1:
				return "failed", true
			case strings.HasPrefix(key, "silent-") && attempt == 1:
				return "", false
			}
			return "succeeded", true
		})

	// The throttled queue's running weight, sampled while the jobs run.
	var peak atomic.Int64
	var sampler sync.WaitGroup
	sampler.Go(func() {
		for ctx.Err() == nil {
			var n int64
			if err := db.QueryRow(ctx, `SELECT coalesce(sum(throttle_factor), 0) FROM hipq_job WHERE queue = 'slow' AND state = 'running'`).Scan(&n); err == nil && n > peak.Load() {
				peak.Store(n)
			}
			time.Sleep(5 * time.Millisecond) // a sampling period, not a wait for a condition
		}
	})

	var recs []*kgo.Record
	var keys []string
	add := func(typ, key string) {
		keys = append(keys, key)
		recs = append(recs, &kgo.Record{Topic: e.kafka.Topic("jobs"), Partition: int32(len(keys) % 2),
			Value: fmt.Appendf(nil, `{"job_type":%q,"job_key":%q,"job_data":{"key":%q}}`, typ, key, key)})
	}
	for i := range 60 {
		add("e2e", fmt.Sprintf("ok-%02d", i))
	}
	for i := range 15 {
		add("e2e", fmt.Sprintf("fail-%02d", i))
	}
	for i := range 5 {
		add("e2e", fmt.Sprintf("silent-%02d", i))
	}
	for i := range 30 {
		add("slow", fmt.Sprintf("slow-%02d", i))
	}
	n := len(recs)
	// Malformed records, on both partitions of the intake topic: each a
	// dead letter, kept in the coordinator's table from whichever node
	// its consumer is connected to.
	for p := range int32(2) {
		for i := range 2 {
			recs = append(recs, &kgo.Record{Topic: e.kafka.Topic("jobs"), Partition: p, Value: fmt.Appendf(nil, `{"not a job": %d}`, i)})
		}
	}
	e.produceTo(recs...)
	testutil.Eventually(t, 90*time.Second, func() (bool, string) {
		done := e.countJobs(a, "state = 'final'")
		return done == n, fmt.Sprintf("%d of %d final", done, n)
	}, "every job to end")
	cancel()
	sampler.Wait()

	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		got := scalarInt(t, db, "SELECT count(*) FROM hipq_dead_letter")
		return got == 4, fmt.Sprintf("%d dead letters", got)
	}, "the 4 malformed records to be dead letters")
	if got := e.countJobs(a, "true"); got != n {
		t.Errorf("%d jobs for %d records", got, n)
	}
	if got := e.countJobs(a, "outcome = 'succeeded'"); got != n {
		t.Errorf("%d of %d jobs succeeded", got, n)
	}
	for prefix, want := range map[string]int{"ok-": 1, "slow-": 1, "fail-": 2, "silent-": 2} {
		if bad := e.countJobs(a, fmt.Sprintf("job_key LIKE '%s%%' AND attempt <> %d", prefix, want)); bad != 0 {
			t.Errorf("%d jobs %s* ended after another attempt than %d", bad, prefix, want)
		}
	}
	if p := peak.Load(); p > 3 {
		t.Errorf("the throttled queue ran %d jobs at once across the two instances, limit 3", p)
	}
	byInstance := map[string]int{}
	rows, err := db.Query(context.Background(), `SELECT instance, count(*) FROM hipq_attempt GROUP BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var inst string
		var c int
		if err := rows.Scan(&inst, &c); err != nil {
			t.Fatal(err)
		}
		byInstance[inst] = c
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	if byInstance[a.instance] == 0 || byInstance[b.instance] == 0 {
		t.Errorf("attempts by instance %v: want both %s (coordinator) and %s (worker) to claim", byInstance, a.instance, b.instance)
	}
	t.Logf("attempts by instance: coordinator's %d, worker's %d; the throttled queue's peak %d of 3",
		byInstance[a.instance], byInstance[b.instance], peak.Load())

	// Every job's final event, and the retries' before it on the topic.
	retries := 15 + 5
	evs := e.readEvents("events", n+retries)
	first := map[string]map[string]int{} // key: outcome: first offset seen
	ids := map[string]bool{}
	for i, r := range evs {
		k, out := string(r.Key), recHeader(r, "hipq-outcome")
		if first[k] == nil {
			first[k] = map[string]int{}
		}
		if _, ok := first[k][out]; !ok {
			first[k][out] = i
		}
		ids[recHeader(r, "hipq-event-id")] = true
	}
	for _, k := range keys {
		f := first[k]
		if _, ok := f["succeeded"]; !ok {
			t.Errorf("%s: no final event (%v)", k, f)
			continue
		}
		if strings.HasPrefix(k, "fail-") || strings.HasPrefix(k, "silent-") {
			r, ok := f["retry"]
			if !ok || r > f["succeeded"] {
				t.Errorf("%s: its retry's event (at %d, seen %v) does not come before its final one (at %d)", k, r, ok, f["succeeded"])
			}
		}
	}
	if len(ids) != n+retries {
		t.Errorf("%d distinct event ids, want %d", len(ids), n+retries)
	}
	if left := scalarInt(t, db, "SELECT count(*) FROM hipq_event"); left != 0 {
		t.Errorf("%d events still wait in PostgreSQL", left)
	}
	// One relay holds its lease, named after its process.
	var holders int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM hipq_lock WHERE name = 'relay' AND until > now()`).Scan(&holders); err != nil || holders != 1 {
		t.Errorf("relay leases held: %d (%v), want 1", holders, err)
	}
}

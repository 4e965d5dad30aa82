package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/testutil"
)

// schedConfig has one throttled queue with shares (limit 6: east, west and
// the pool of every other region 2 each), a critical type, a capped type,
// and two unthrottled-but-serial queues for the ordering test.
const schedConfig = `
name: sched
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"], session_timeout: 6s}
intake: {topics: ["{{T:jobs}}"]}
responses: {topics: [{topic: "{{T:replies}}"}]}
dispatch: {interval: 100ms, batch_size: 50, grace: 1s}
sweeper: {schedule: "@every 1s"}
queues:
  - name: limited
    throttle_limit: 6
    shares: {by: {json: /region}, weights: {east: 50, west: 50, "*": 50}}
  - name: by_priority
    order: priority_first
    throttle_limit: 1
  - name: by_time
    order: scheduled_first
    throttle_limit: 1
job_types:
  - {name: light, queue: limited, transport: {kafka: {topic: "{{T:requests}}"}}, timeout: 30s}
  - {name: heavy, queue: limited, throttle_factor: 2, transport: {kafka: {topic: "{{T:requests}}"}}, timeout: 30s}
  - {name: crit, queue: limited, critical: true, throttle_factor: 6, transport: {kafka: {topic: "{{T:requests}}"}}, timeout: 30s}
  - {name: capped, queue: limited, max_concurrency: 2, transport: {kafka: {topic: "{{T:requests}}"}}, timeout: 30s}
  - {name: prio, queue: by_priority, transport: {kafka: {topic: "{{T:requests}}"}}, timeout: 30s}
  - {name: timed, queue: by_time, transport: {kafka: {topic: "{{T:requests}}"}}, timeout: 30s}
`

var schedTopics = []string{"jobs", "requests", "replies"}

func schedJob(typ, key, region string, extra string) string {
	data := "{}"
	if region != "" {
		data = fmt.Sprintf(`{"region":%q}`, region)
	}
	return fmt.Sprintf(`{"job_type":%q,"job_key":%q,"job_data":%s%s}`, typ, key, data, extra)
}

// sampler polls one SQL query until stopped, keeping each column's peak
// and failing the test when one passes its bound.
type sampler struct {
	mu     sync.Mutex
	peaks  []int
	n      int
	stop   chan struct{}
	done   chan struct{}
	failed []string
}

func (e *env) sample(a *app, query string, names []string, bounds []int) *sampler {
	s := &sampler{peaks: make([]int, len(bounds)), stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		vals := make([]int, len(bounds))
		ptrs := make([]any, len(bounds))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-s.stop:
				return
			case <-tick.C:
			}
			if err := a.st.Pool().QueryRow(context.Background(), query).Scan(ptrs...); err != nil {
				continue
			}
			s.mu.Lock()
			s.n++
			for i, v := range vals {
				s.peaks[i] = max(s.peaks[i], v)
				if v > bounds[i] && len(s.failed) < 10 {
					s.failed = append(s.failed, fmt.Sprintf("%s = %d, above its bound %d", names[i], v, bounds[i]))
				}
			}
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *sampler) finish(t *testing.T) []int {
	t.Helper()
	close(s.stop)
	<-s.done
	for _, f := range s.failed {
		t.Error(f)
	}
	t.Logf("%d samples, peaks %v", s.n, s.peaks)
	return s.peaks
}

// Two instances dispatch one throttled queue over one database with slow
// replies: sampled all along, the running weight never passes the queue
// limit nor any share partition's cap, and both are reached.
func TestThrottleAcrossTwoInstances(t *testing.T) {
	t.Parallel()
	e := newEnv(t, schedTopics...)
	cfg := e.config(schedConfig)
	a := e.start(cfg)
	b := e.start(cfg, "dispatcher", "responses")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(1, 2))
	e.respondAfter(ctx, "requests", "replies", func() time.Duration {
		mu.Lock()
		defer mu.Unlock()
		return time.Duration(50+r.IntN(200)) * time.Millisecond
	}, func(string, int) (string, bool) { return "succeeded", true })

	s := e.sample(a, `
		SELECT coalesce(sum(throttle_factor), 0),
		       coalesce(sum(throttle_factor) FILTER (WHERE job_data->>'region' = 'east'), 0),
		       coalesce(sum(throttle_factor) FILTER (WHERE job_data->>'region' = 'west'), 0),
		       coalesce(sum(throttle_factor) FILTER (WHERE job_data->>'region' IS DISTINCT FROM 'east'
		                                              AND job_data->>'region' IS DISTINCT FROM 'west'), 0)
		FROM hipq_job WHERE queue = 'limited' AND state = 'running' AND job_type <> 'crit'`,
		[]string{"queue weight", "east weight", "west weight", "pooled weight"}, []int{6, 2, 2, 2})
	var reqs []string
	regions := []string{"east", "west", "north", "south", ""}
	for i := range 80 {
		typ := "light"
		if i%3 == 0 {
			typ = "heavy"
		}
		reqs = append(reqs, schedJob(typ, fmt.Sprintf("j%d", i), regions[i%len(regions)], ""))
	}
	// Heavier than its partition's cap of 2: it could never run, so it is refused.
	reqs = append(reqs, schedJob("heavy", "too-heavy", "east", `,"throttle_factor":3`))
	e.produce("jobs", reqs...)
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		n := e.countJobs(a, "state = 'final' AND outcome = 'succeeded'")
		return n == 80, fmt.Sprintf("%d succeeded", n)
	}, "all jobs final")
	peaks := s.finish(t)
	if !slices.Equal(peaks, []int{6, 2, 2, 2}) {
		t.Errorf("peaks %v: the limits were never reached, so the test proved little", peaks)
	}
	var instances int
	_ = a.st.Pool().QueryRow(ctx, "SELECT count(DISTINCT instance) FROM hipq_attempt").Scan(&instances)
	if instances != 2 {
		t.Errorf("%d instances dispatched, want both", instances)
	}
	var reason string
	_ = a.st.Pool().QueryRow(ctx, "SELECT reason FROM hipq_dead_letter").Scan(&reason)
	if !strings.Contains(reason, `share of partition "east"`) {
		t.Errorf("the too-heavy job was not refused: dead letter %q", reason)
	}
	_ = b
}

// max_concurrency caps a type by count; a critical type runs while its
// queue is full (of jobs whose replies never come) and takes none of its
// capacity.
func TestCriticalAndMaxConcurrency(t *testing.T) {
	t.Parallel()
	e := newEnv(t, schedTopics...)
	a := e.start(e.config(schedConfig))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.respondAfter(ctx, "requests", "replies", func() time.Duration { return 100 * time.Millisecond },
		func(key string, _ int) (string, bool) { return "succeeded", !strings.HasPrefix(key, "block") })

	s := e.sample(a, `SELECT count(*) FILTER (WHERE job_type = 'capped') FROM hipq_job WHERE state = 'running'`,
		[]string{"running capped"}, []int{2})
	var reqs []string
	for i := range 12 {
		reqs = append(reqs, schedJob("capped", fmt.Sprintf("cap-%d", i), "", ""))
	}
	e.produce("jobs", reqs...)
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(a, "job_type = 'capped' AND outcome = 'succeeded'")
		return n == 12, fmt.Sprintf("%d capped succeeded", n)
	}, "capped jobs done")
	if peaks := s.finish(t); peaks[0] != 2 {
		t.Errorf("capped peaked at %d running, want its cap 2 reached", peaks[0])
	}

	// Fill the queue: 3 heavy jobs (weight 6) in three partitions that never get a reply.
	e.produce("jobs", schedJob("heavy", "block-e", "east", ""), schedJob("heavy", "block-w", "west", ""),
		schedJob("heavy", "block-n", "north", ""))
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		n := e.countJobs(a, "state = 'running'")
		return n == 3, fmt.Sprintf("%d running", n)
	}, "queue full")
	reqs = nil
	for i := range 10 {
		reqs = append(reqs, schedJob("crit", fmt.Sprintf("crit-%d", i), "east", ""))
	}
	reqs = append(reqs, schedJob("light", "waits", "south", ""))
	e.produce("jobs", reqs...)
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(a, "job_type = 'crit' AND outcome = 'succeeded'")
		return n == 10, fmt.Sprintf("%d critical succeeded", n)
	}, "critical jobs done beside a full queue")
	if n := e.countJobs(a, "job_key = 'waits' AND state = 'initial'"); n != 1 {
		t.Errorf("a light job ran although the queue was full")
	}
}

// With limit 1, priority_first dispatches in priority order and
// scheduled_first in scheduled time order, whatever the arrival order.
func TestDispatchOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t, schedTopics...)
	cfg := e.config(schedConfig)
	in := e.start(cfg, "intake")
	base := time.Now().Add(-2 * time.Hour).UTC()
	sched := func(min int) string {
		return fmt.Sprintf(`,"scheduled_run_time":%q`, base.Add(time.Duration(min)*time.Minute).Format(time.RFC3339))
	}
	var reqs []string
	// Arrival order, priority and scheduled time all disagree.
	for i, p := range []int{50, 10, 90, 30, 70, 20} {
		reqs = append(reqs, schedJob("prio", fmt.Sprintf("p%d", p), "", fmt.Sprintf(`,"priority":%d%s`, p, sched(i))))
		reqs = append(reqs, schedJob("timed", fmt.Sprintf("t%d", p), "", fmt.Sprintf(`,"priority":%d%s`, 100-p, sched(p))))
	}
	e.produce("jobs", reqs...)
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		n := e.countJobs(in, "true")
		return n == 12, fmt.Sprintf("%d jobs", n)
	}, "jobs stored")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.respond(ctx, "requests", "replies", func(string, int) (string, bool) { return "succeeded", true })
	e.start(cfg, "dispatcher", "responses")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(in, "outcome = 'succeeded'")
		var left string
		_ = in.st.Pool().QueryRow(ctx, "SELECT string_agg(job_key || ':' || state || ':' || scheduled_run_time::text, ',') FROM hipq_job WHERE outcome IS DISTINCT FROM 'succeeded'").Scan(&left)
		return n == 12, fmt.Sprintf("%d succeeded; left %s", n, left)
	}, "all jobs final")
	order := func(typ string) []string {
		rows, err := in.st.Pool().Query(ctx, `SELECT j.job_key FROM hipq_attempt a JOIN hipq_job j ON j.queue = a.queue AND j.id = a.job_id
			WHERE j.job_type = $1 ORDER BY a.dispatched_at`, typ)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var out []string
		for rows.Next() {
			var k string
			_ = rows.Scan(&k)
			out = append(out, k)
		}
		return out
	}
	want := []string{"p10", "p20", "p30", "p50", "p70", "p90"}
	if got := order("prio"); !slices.Equal(got, want) {
		t.Errorf("priority_first dispatched %v, want %v", got, want)
	}
	want = []string{"t10", "t20", "t30", "t50", "t70", "t90"}
	if got := order("timed"); !slices.Equal(got, want) {
		t.Errorf("scheduled_first dispatched %v, want %v", got, want)
	}
}

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/internal/testutil"
)

const heartbeatConfig = `
name: hb
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"]}
intake: {topics: ["{{T:jobs}}"]}
responses: {topics: [{topic: "{{T:replies}}"}]}
dispatch: {interval: 100ms}
sweeper: {schedule: "@every 1s"}
queues: [{name: default}]
job_types:
  - {name: hb, transport: {kafka: {topic: "{{T:requests}}"}}, timeout: 2s, max_timeout: 20s}
  - {name: hbcap, transport: {kafka: {topic: "{{T:requests}}"}}, timeout: 2s, max_timeout: 5s}
`

// progressWorker answers each request as its key says: "steady" sends
// progress every second for 6 s then succeeds; "stops" sends two progress
// replies then nothing; "endless" sends progress every second for ever.
func (e *env) progressWorker(ctx context.Context) {
	cl := e.kafka.Client(kgo.ConsumeTopics(e.kafka.Topic("requests")), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	send := func(rec *kgo.Record, status string, n int) {
		var hs []kgo.RecordHeader
		for _, h := range rec.Headers {
			if strings.HasPrefix(h.Key, "hipq-") {
				hs = append(hs, h)
			}
		}
		cl.Produce(ctx, &kgo.Record{Topic: e.kafka.Topic("replies"), Key: rec.Key, Headers: hs,
			Value: fmt.Appendf(nil, `{"status":%q,"done":%d}`, status, n)}, nil)
	}
	work := func(rec *kgo.Record) {
		key := string(rec.Key)
		for n := 1; ctx.Err() == nil; n++ {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
			switch {
			case strings.HasPrefix(key, "steady") && n > 6:
				send(rec, "succeeded", n)
				return
			case strings.HasPrefix(key, "stops") && n > 2:
				return
			}
			send(rec, "progress", n)
		}
	}
	go func() {
		defer cl.Close()
		for ctx.Err() == nil {
			cl.PollFetches(ctx).EachRecord(func(rec *kgo.Record) { go work(rec) })
		}
	}()
}

// News extends a running attempt, never past max_timeout: progress every
// second for 6 s under a 2 s timeout then success → succeeded at attempt
// 1; progress that stops → timed out one timeout after the last; endless
// progress → timed out at max_timeout.
func TestProgressExtendsTheDeadline(t *testing.T) {
	e := newEnv(t, "jobs", "requests", "replies")
	a := e.start(e.config(heartbeatConfig))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.progressWorker(ctx)
	e.produce("jobs", `{"job_type":"hb","job_key":"steady"}`, `{"job_type":"hb","job_key":"stops"}`, `{"job_type":"hbcap","job_key":"endless"}`)
	type end struct {
		outcome, errText       string
		attempt                int
		started, ended, newsAt time.Time
		progress               string
	}
	read := func(key string) (end, bool) {
		var x end
		var outcome, progress *string
		var newsAt *time.Time
		err := e.pool().QueryRow(context.Background(), `
			SELECT j.outcome, j.error, j.attempt, a.dispatched_at, j.update_time, a.progress_at, a.progress::text
			FROM hipq_job j JOIN hipq_attempt a ON a.queue = j.queue AND a.job_id = j.id AND a.attempt = j.attempt
			WHERE j.job_key = $1 AND j.state = 'final'`, key).Scan(&outcome, &x.errText, &x.attempt, &x.started, &x.ended, &newsAt, &progress)
		if err != nil {
			return x, false
		}
		x.outcome = *outcome
		if newsAt != nil {
			x.newsAt = *newsAt
		}
		if progress != nil {
			x.progress = *progress
		}
		return x, true
	}
	ends := map[string]end{}
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		for _, k := range []string{"steady", "stops", "endless"} {
			if x, ok := read(k); ok {
				ends[k] = x
			}
		}
		return len(ends) == 3, fmt.Sprint(ends)
	}, "the three jobs final")
	if s := ends["steady"]; s.outcome != "succeeded" || s.attempt != 1 || s.ended.Sub(s.started) < 6*time.Second {
		t.Errorf("steady: %+v, want succeeded@1 after 6 s of progress", s)
	}
	if s := ends["stops"]; s.outcome != "timed_out" || s.errText != "timeout" || s.newsAt.IsZero() ||
		s.ended.Sub(s.newsAt) < 2*time.Second || s.ended.Sub(s.newsAt) > 4*time.Second || !strings.Contains(s.progress, `"done": 2`) {
		t.Errorf("stops: %+v, want timed out one timeout (2 s, + the sweep's second) after its last progress", s)
	}
	if s := ends["endless"]; s.outcome != "timed_out" || s.errText != "timeout" ||
		s.ended.Sub(s.started) < 5*time.Second || s.ended.Sub(s.started) > 7*time.Second {
		t.Errorf("endless: %+v, want timed out at max_timeout (5 s, + the sweep's second) after its start", s)
	}
	m := scrape(t, a.metrics.Handler())
	if m[`hipq_replies_total{result="progress",source="kafka"}`] < 8 {
		t.Errorf("progress replies counted: %v", m[`hipq_replies_total{result="progress",source="kafka"}`])
	}
}

// An HTTP downstream gets a signed Hipq-Heartbeat-Url: a POST to it moves
// the deadline and records its body as progress (shown by GET
// /v1/jobs/…); the answer says when the job was cancelled; the URL can
// never end the job (its sig is refused on the callback URL).
func TestHTTPHeartbeat(t *testing.T) {
	var mu sync.Mutex
	var heartbeatURL, callbackURL string
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		heartbeatURL, callbackURL = r.Header.Get("Hipq-Heartbeat-Url"), r.Header.Get("Hipq-Callback-Url")
		mu.Unlock()
		w.WriteHeader(http.StatusAccepted)
	}))
	defer down.Close()
	e := newEnv(t, "jobs", "replies")
	text, api := withAPI(t, `
name: hbhttp
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"]}
responses: {topics: [{topic: "{{T:replies}}"}]}
dispatch: {interval: 100ms}
sweeper: {schedule: "@every 1s"}
queues: [{name: default}]
job_types:
  - {name: work, transport: {http: {url: "`+down.URL+`", timeout: 1s}}, timeout: 2s, max_timeout: 30s}
`, `, public_url: "http://PUBLIC"`)
	a := e.start(e.config(text))
	waitAPI(t, api)
	resp, err := http.DefaultClient.Do(mustReq(t, http.MethodPut, api+"/v1/jobs/work/w1", `{"job_data":{}}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close() // (an unread, unclosed body keeps its connection and two goroutines)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("enqueue: %d", resp.StatusCode)
	}
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		return heartbeatURL != "", ""
	}, "the request")
	mu.Lock()
	hb := strings.Replace(heartbeatURL, "http://PUBLIC", api, 1)
	cb := strings.Replace(callbackURL, "http://PUBLIC", api, 1)
	mu.Unlock()
	post := func(url, body string) (int, map[string]any) {
		t.Helper()
		resp, err := http.Post(url, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var out map[string]any
		_ = json.Unmarshal(b, &out)
		return resp.StatusCode, out
	}
	// Beat every 500 ms for 4 s: twice the 2 s timeout.
	for range 8 {
		code, out := post(hb, `{"percent": 40}`)
		if code != http.StatusOK || out["accepted"] != true || out["deadline"] == nil {
			t.Fatalf("heartbeat: %d %v", code, out)
		}
		time.Sleep(500 * time.Millisecond)
	}
	var state string
	if err := e.pool().QueryRow(context.Background(), "SELECT state FROM hipq_job WHERE job_key = 'w1'").Scan(&state); err != nil || state != "running" {
		t.Fatalf("after 4 s of heartbeats under a 2 s timeout: %s %v", state, err)
	}
	resp, err = http.Get(api + "/v1/jobs/work/w1")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"progress":{"percent":40}`) || !strings.Contains(string(b), `"deadline":`) {
		t.Errorf("GET shows no progress: %s", b)
	}
	// The heartbeat's sig is not a callback's: it cannot end the job.
	hbSig := hb[strings.Index(hb, "sig=")+4:]
	forged := cb[:strings.Index(cb, "sig=")+4] + hbSig
	if code, _ := post(forged, `{"status": "succeeded"}`); code != http.StatusUnauthorized {
		t.Errorf("a heartbeat sig on the callback URL: %d, want 401", code)
	}
	if code, _ := post(hb+"x", `{}`); code != http.StatusUnauthorized {
		t.Errorf("a bad sig: %d, want 401", code)
	}
	if code, _ := post(hb, `{"percent":`); code != http.StatusBadRequest {
		t.Errorf("a body that is not JSON: %d, want 400", code)
	}
	// Cancelled: the next beat says so.
	resp, err = http.Post(api+"/v1/jobs/work/w1/cancel", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("cancel: %d", resp.StatusCode)
	}
	code, out := post(hb, ``)
	if code != http.StatusOK || out["accepted"] != false || out["cancelled"] != true || out["state"] != "final" {
		t.Errorf("a beat after cancel: %d %v", code, out)
	}
	if m := scrape(t, a.metrics.Handler()); m[`hipq_replies_total{result="progress",source="heartbeat"}`] != 8 {
		t.Errorf("heartbeats counted: %v", m[`hipq_replies_total{result="progress",source="heartbeat"}`])
	}
}

func mustReq(t *testing.T, method, url, body string) *http.Request {
	t.Helper()
	r, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	r.Header.Set("Content-Type", "application/json")
	return r
}

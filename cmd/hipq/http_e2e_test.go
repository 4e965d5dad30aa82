package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/testutil"
)

// The HTTP side end to end: a job enqueued through the API is sent to an
// httptest downstream (async), which answers later on the signed callback
// URL; the job ends succeeded with the callback's result.
func TestHTTPAsyncWithCallback(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "jobs")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	apiAddr := l.Addr().String()
	l.Close()
	calls := make(chan string, 10)
	downstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls <- r.URL.Path
		cb := r.Header.Get("Hipq-Callback-Url")
		w.WriteHeader(http.StatusAccepted)
		go func() { // the work is done later, and reported on the callback URL
			resp, err := http.Post(cb, "application/json", strings.NewReader(`{"status": "succeeded", "result": {"label": "L-1"}}`))
			if err != nil {
				t.Errorf("callback: %v", err)
				return
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("callback answered %d", resp.StatusCode)
			}
		}()
	}))
	defer downstream.Close()
	token := strings.Repeat("T", 32)
	cfg := e.config(fmt.Sprintf(`
name: web
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"]}
intake: {topics: ["{{T:jobs}}"]}
dispatch: {interval: 100ms}
api: {listen: "%s", public_url: "http://%s", tokens: ["%s"], callback_secret: "%s"}
job_types:
  - name: label.print
    transport: {http: {url: "%s/labels/{job_key}", timeout: 5s, mode: async}}
    timeout: 1m
`, apiAddr, apiAddr, token, strings.Repeat("S", 32), downstream.URL))
	a := e.start(cfg)
	var status int
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		req, _ := http.NewRequest(http.MethodPut, "http://"+apiAddr+"/v1/jobs/label.print/p1", strings.NewReader(`{"job_data": {"sku": 7}}`))
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		status = resp.StatusCode
		return true, ""
	}, "API up")
	if status != http.StatusCreated {
		t.Fatalf("enqueue answered %d", status)
	}
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		j, err := a.st.JobGet(context.Background(), "label.print", "p1")
		if err != nil {
			return false, err.Error()
		}
		return j.Outcome == correlator.OutcomeSucceeded && string(j.Result) == `{"label": "L-1"}`,
			fmt.Sprintf("%s %s %s", j.State, j.Outcome, j.Result)
	}, "job finalized by its callback")
	if p := <-calls; p != "/labels/p1" {
		t.Fatalf("downstream called at %s", p)
	}
	// /metrics needs no token and shows the job's way through.
	resp, err := http.Get("http://" + apiAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics answered %d", resp.StatusCode)
	}
	wantMetrics(t, parseMetrics(t, string(body)), map[string]float64{
		`hipq_intake_records_total{result="accepted",source="api"}`:             1,
		`hipq_dispatches_total{queue="default",result="sent",transport="http"}`: 1,
		`hipq_replies_total{result="applied",source="callback"}`:                1,
		`hipq_round_trip_seconds_count{job_type="label.print"}`:                 1,
		`hipq_jobs{queue="default",state="initial"}`:                            0,
	})
}

package main

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/hipq/hipq/internal/testutil"
)

// Issue 9.17: the API never starves the hot path. Its connections are its
// own, bounded by api.max_conns: with every one of them held, intake still
// makes jobs. Its statements are bounded by api.request_timeout: a cancel
// that waits on a locked row answers 503 within it instead of hanging.
func TestAPIConnectionsApartFromTheHotPath(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	text, url := withAPI(t, e2eConfig, ", max_conns: 2, request_timeout: 1s")
	a := e.start(e.config(text), "intake", "api")
	if a.apiStore == nil || a.apiStore.Pool() == a.st.Pool() {
		t.Fatal("the API shares the hot path's pool")
	}
	waitAPI(t, url)
	e.produce("jobs", jobReq("locked"))
	testutil.Eventually(t, 20*time.Second, func() (bool, string) { return e.countJobs(a, "job_key = 'locked'") == 1, "" }, "the first job")

	// A row lock held elsewhere: the API's cancel waits on it, and gives up
	// at the request timeout.
	tx, err := a.st.Pool().Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(context.Background(), `SELECT 1 FROM hipq_job WHERE queue = 'default' AND job_key = 'locked' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	resp, err := http.Post(url+"/v1/jobs/e2e/locked/cancel", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || time.Since(start) > 10*time.Second {
		t.Fatalf("cancel on a locked row: %d %v after %v, want 503 at the request timeout", resp.StatusCode, out, time.Since(start))
	}
	_ = tx.Rollback(context.Background())

	// Every API connection held: the hot path does not notice.
	var held []*pgxpool.Conn
	for range 2 {
		c, err := a.apiStore.Pool().Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	if n := a.apiStore.Pool().Stat().MaxConns(); n != 2 {
		t.Fatalf("API pool of %d connections, want api.max_conns 2", n)
	}
	e.produce("jobs", jobReq("while-api-busy"))
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		return e.countJobs(a, "job_key = 'while-api-busy'") == 1, ""
	}, "intake while the API's connections are all taken")
}

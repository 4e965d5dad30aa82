package dispatcher_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/pgtest"
)

// A 429 with Retry-After: 3 schedules the next attempt no earlier than 3
// seconds after the claim, on the database's clock, though the policy
// would retry after a millisecond; the job is not claimed before then.
func TestRetryAfterHonoured(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("Retry-After", "3")
		w.WriteHeader(http.StatusTooManyRequests)
	}))
	defer srv.Close()
	st := pgtest.New(t)
	retry := &correlator.Backoff{Attempts: 3, Initial: time.Millisecond, Max: time.Hour,
		When: []correlator.AttemptOutcome{correlator.AttemptDispatchError}}
	types := map[string]*correlator.JobType{"web": {Name: "web", Queue: "default", Timeout: time.Hour, Retry: retry}}
	s := dispatcher.NewHTTPSender(dispatcher.HTTPSenderConfig{
		Routes: map[string]dispatcher.HTTPRoute{"web": {URL: srv.URL + "/{job_key}", Timeout: 5 * time.Second}}})
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", Queues: []dispatcher.QueueConfig{{Name: "default"}},
		Types: types, Senders: map[string]dispatcher.Sender{"web": s}})
	j := &correlator.Job{Queue: "default", JobType: "web", JobKey: "k", JobData: json.RawMessage(`{}`), MaxAttempts: 3,
		Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)}
	if _, err := st.JobsInsert(ctx, []*correlator.Job{j}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	var state string
	var wait float64
	if err := st.Pool().QueryRow(ctx, `SELECT j.state, extract(epoch FROM j.scheduled_run_time - a.dispatched_at)::float8
		FROM hipq_job j JOIN hipq_attempt a ON a.queue = j.queue AND a.job_id = j.id AND a.attempt = 1`).Scan(&state, &wait); err != nil {
		t.Fatal(err)
	}
	if state != "retry" || wait < 3 || wait > 4 {
		t.Fatalf("after a 429 with Retry-After 3: %s, next attempt %.3fs after the claim, want retry at 3s", state, wait)
	}
	if n, err := d.RunOnce(ctx); err != nil || n != 0 || calls.Load() != 1 {
		t.Fatalf("claimed %d again at once (%v), %d calls", n, err, calls.Load())
	}
}

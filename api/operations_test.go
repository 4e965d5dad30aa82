package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

func operation(out map[string]any) map[string]any {
	op, _ := out["operation"].(map[string]any)
	return op
}

// wantOperation checks an answer's operation: its state and counts.
func wantOperation(t *testing.T, out map[string]any, state string, matched, done, skipped int) map[string]any {
	t.Helper()
	op := operation(out)
	if op["state"] != state || op["matched"] != float64(matched) || op["done"] != float64(done) || op["skipped"] != float64(skipped) {
		t.Fatalf("operation %v: want %s, matched %d, done %d, skipped %d", op, state, matched, done, skipped)
	}
	return op
}

// The bulk actions through the API: a dry run counts and changes nothing;
// a cancel, replay and run-now act on their filter only and answer their
// counts; run again they do nothing more; a dead-letter replay replays
// what the config now takes; the operation can be read back; each action
// is logged once with its filter, reason, token name and counts.
func TestBulkActions(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zap.InfoLevel)
	e := newAPILogged(t, zap.New(core), func(*Config) {}, token)
	for _, k := range []string{"a-1", "a-2", "a-3", "b-1"} {
		e.want("PUT", "/v1/jobs/t/"+k, `{}`, 201)
	}
	later := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	e.want("PUT", "/v1/jobs/t/later-1", `{"scheduled_run_time": "`+later+`"}`, 201)

	out := e.want("POST", "/v1/jobs/cancel", `{"filter": {"key_prefix": "a-"}, "reason": "tenant a left", "dry_run": true}`, 200)
	if out["dry_run"] != true || out["matched"] != float64(3) || out["kind"] != "jobs.cancel" {
		t.Fatalf("dry run: %v", out)
	}
	if f, _ := out["filter"].(map[string]any); f["key_prefix"] != "a-" || f["created_before"] == nil {
		t.Fatalf("dry run's filter: %v, want the implicit created_before shown", out["filter"])
	}
	if j := job(e.want("GET", "/v1/jobs/t/a-1", "", 200)); j["state"] != "initial" {
		t.Fatalf("a dry run changed a job: %v", j)
	}

	op := wantOperation(t, e.want("POST", "/v1/jobs/cancel", `{"filter": {"key_prefix": "a-"}, "reason": "tenant a left"}`, 200),
		"done", 3, 3, 0)
	if op["kind"] != "jobs.cancel" || op["reason"] != "tenant a left" || op["token_name"] != nameOf(token) {
		t.Fatalf("operation: %v", op)
	}
	for k, want := range map[string]string{"a-1": "cancelled", "a-3": "cancelled", "b-1": ""} {
		j := job(e.want("GET", "/v1/jobs/t/"+k, "", 200))
		if got, _ := j["outcome"].(string); got != want {
			t.Errorf("%s: outcome %v, want %q", k, j["outcome"], want)
		}
	}
	wantOperation(t, e.want("POST", "/v1/jobs/cancel", `{"filter": {"key_prefix": "a-"}, "reason": "again"}`, 200), "done", 0, 0, 0)
	id := int(op["id"].(float64))
	wantOperation(t, e.want("GET", fmt.Sprintf("/v1/operations/%d", id), "", 200), "done", 3, 3, 0)
	if out := e.want("DELETE", fmt.Sprintf("/v1/operations/%d", id), "", 409); errCode(out) != "final" {
		t.Fatalf("stop of a done operation: %v", out)
	}
	e.want("GET", "/v1/operations/999", "", 404)
	e.want("GET", "/v1/operations/x", "", 400)

	// Replay: each key once; again, each skipped.
	wantOperation(t, e.want("POST", "/v1/jobs/replay", `{"filter": {"key_prefix": "a-", "outcome": "cancelled"}, "reason": "retry them"}`, 200),
		"done", 3, 3, 0)
	if j := job(e.want("GET", "/v1/jobs/t/a-2", "", 200)); j["state"] != "initial" {
		t.Fatalf("a-2 after the replay: %v", j)
	}
	wantOperation(t, e.want("POST", "/v1/jobs/replay", `{"filter": {"key_prefix": "a-", "state": "final"}, "reason": "again"}`, 200),
		"done", 3, 0, 3)

	// Run-now: the waiting jobs of the filter scheduled later.
	wantOperation(t, e.want("POST", "/v1/jobs/run-now", `{"filter": {"job_type": "t", "state": "initial"}, "reason": "now"}`, 200),
		"done", 5, 1, 4) // a-1..3 (replayed), b-1: due already
	j := job(e.want("GET", "/v1/jobs/t/later-1", "", 200))
	if due, err := time.Parse(time.RFC3339Nano, j["scheduled_run_time"].(string)); err != nil || due.After(time.Now()) {
		t.Fatalf("later-1 is not due: %v", j)
	}

	// Dead letters: those the config now takes are replayed.
	if err := e.st.DeadLetterInsert(ctx, []store.DeadLetter{
		{Kind: store.SourceIntake, Reason: "unknown_job_type: t", Source: store.Source{Value: []byte(`{"job_type": "t", "job_key": "dl-1"}`)}},
		{Kind: store.SourceIntake, Reason: "unknown_job_type: u", Source: store.Source{Value: []byte(`{"job_type": "u", "job_key": "dl-2"}`)}},
		{Kind: store.SourceReply, Reason: "no_job: x", Source: store.Source{Topic: "custom", Value: []byte(`{"kind": "t", "ref": "nope", "state": "done"}`)}},
	}); err != nil {
		t.Fatal(err)
	}
	wantOperation(t, e.want("POST", "/v1/dead-letters/replay", `{"filter": {"source": "intake"}, "reason": "t is configured now"}`, 200),
		"done", 2, 1, 1)
	if j := job(e.want("GET", "/v1/jobs/t/dl-1", "", 200)); j["state"] != "initial" {
		t.Fatalf("dl-1: %v", j)
	}

	ended := logs.FilterMessage("bulk action done").All()
	if len(ended) != 6 {
		t.Fatalf("%d bulk actions logged as done, want 6 (one each)", len(ended))
	}
	f := ended[0].ContextMap()
	if f["reason"] != "tenant a left" || f["token_name"] != nameOf(token) || f["matched"] != int64(3) || f["done"] != int64(3) ||
		f["skipped"] != int64(0) || f["kind"] != "jobs.cancel" || f["filter"] == nil {
		t.Fatalf("the log of the cancel: %v", f)
	}
	if n := logs.FilterMessage("bulk action counted (dry run)").Len(); n != 1 {
		t.Fatalf("%d dry runs logged, want 1", n)
	}
}

// A bulk action refuses what it cannot do, naming the field: no filter,
// no reason, an unknown field, a time that is not one, a state or outcome
// the action never applies to. Only admin tokens may act, or stop.
func TestBulkActionsRefuse(t *testing.T) {
	t.Parallel()
	read := strings.Repeat("r", 32)
	e := newAPIConfig(t, func(c *Config) { c.ReadTokens = []string{read} }, token)
	e.want("PUT", "/v1/jobs/t/k", `{}`, 201)
	for _, c := range []struct{ path, body, code, names string }{
		{"/v1/jobs/cancel", `{"reason": "x"}`, "empty_filter", "filter: empty"},
		{"/v1/jobs/cancel", `{"filter": {}, "reason": "x"}`, "empty_filter", "filter: empty"},
		{"/v1/dead-letters/replay", `{"filter": {}, "reason": "x"}`, "empty_filter", "received_after"},
		{"/v1/jobs/cancel", `{"filter": {"queue": "default"}}`, "missing_field", "reason"},
		{"/v1/jobs/cancel", `{"filter": {"queue": "default"}, "reason": "  "}`, "missing_field", "reason"},
		{"/v1/jobs/cancel", `{"filter": {"queue": "default"}, "reason": "x", "why": 1}`, "unknown_field", "why"},
		{"/v1/jobs/cancel", `{"filter": {"tenant": "a"}, "reason": "x"}`, "unknown_field", "filter.tenant"},
		{"/v1/jobs/cancel", `{"filter": {"created_after": "yesterday"}, "reason": "x"}`, "invalid_field", "filter.created_after"},
		{"/v1/jobs/cancel", `{"filter": {"queue": 7}, "reason": "x"}`, "invalid_field", "filter.queue"},
		{"/v1/jobs/cancel", `{"filter": {"state": "final"}, "reason": "x"}`, "invalid_field", "filter.state"},
		{"/v1/jobs/cancel", `{"filter": {"outcome": "failed"}, "reason": "x"}`, "invalid_field", "filter.outcome"},
		{"/v1/jobs/replay", `{"filter": {"state": "retry"}, "reason": "x"}`, "invalid_field", "filter.state"},
		{"/v1/jobs/replay", `{"filter": {"outcome": "gone"}, "reason": "x"}`, "invalid_field", "filter.outcome"},
		{"/v1/jobs/run-now", `{"filter": {"state": "running"}, "reason": "x"}`, "invalid_field", "filter.state"},
		{"/v1/dead-letters/replay", `{"filter": {"source": "mail"}, "reason": "x"}`, "invalid_field", "filter.source"},
		{"/v1/dead-letters/replay", `{"filter": {"queue": "default"}, "reason": "x"}`, "unknown_field", "filter.queue"},
		{"/v1/jobs/cancel", `[]`, "not_object", "object"},
	} {
		out := e.want("POST", c.path, c.body, 400)
		msg, _ := out["error"].(map[string]any)["message"].(string)
		if errCode(out) != c.code || !strings.Contains(msg, c.names) {
			t.Errorf("POST %s %s: %v, want %s naming %s", c.path, c.body, out, c.code, c.names)
		}
	}
	id := operation(e.want("POST", "/v1/jobs/run-now", `{"filter": {"queue": "default"}, "reason": "x"}`, 200))["id"]
	e.token = read
	for _, p := range []string{"/v1/jobs/cancel", "/v1/jobs/replay", "/v1/jobs/run-now", "/v1/dead-letters/replay"} {
		if out := e.want("POST", p, `{"filter": {"queue": "default"}, "reason": "x"}`, 403); errCode(out) != "forbidden" {
			t.Errorf("%s with a read token: %v", p, out)
		}
	}
	e.want("DELETE", fmt.Sprintf("/v1/operations/%v", id), "", 403)
	e.want("GET", fmt.Sprintf("/v1/operations/%v", id), "", 200)
	e.token = token
	if j := job(e.want("GET", "/v1/jobs/t/k", "", 200)); j["state"] != "initial" {
		t.Fatalf("a refused bulk action changed a job: %v", j)
	}
}

// An operation that outlasts the request's time is answered 202 and goes
// on; stopped by its instance, another instance's RunOperations takes it
// over from its cursor and ends it, each job acted on once. DELETE stops
// one: no batch after the answer.
func TestBulkOperationOutlastsTheRequestAndResumes(t *testing.T) {
	t.Parallel()
	e := newAPIConfig(t, func(c *Config) { c.RequestTimeout, c.OperationBatch = 300*time.Millisecond, 1 }, token)
	var jobs []*correlator.Job
	for i := range 400 {
		j, err := correlator.NewJob(&correlator.Request{JobType: "t", JobKey: fmt.Sprintf("k%03d", i)}, e.cfg.Types["t"], time.Now())
		if err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, j)
	}
	if _, err := e.st.JobsInsert(ctx, jobs); err != nil {
		t.Fatal(err)
	}
	code, out := e.call("POST", "/v1/jobs/cancel", `{"filter": {"job_type": "t"}, "reason": "outage"}`)
	op := operation(out)
	if code != http.StatusAccepted || op["state"] != "running" {
		t.Fatalf("a long operation: %d %v, want 202 running", code, out)
	}
	id := int64(op["id"].(float64))
	e.srv.Close() // the instance stops: it lets go after its batch
	cut, err := e.st.OperationGet(ctx, id)
	if err != nil || cut.State != store.OperationRunning || cut.Done == 0 || cut.Done == 400 {
		t.Fatalf("after its instance stopped: %+v %v, want running, part done", cut, err)
	}

	cfg := e.cfg
	cfg.OperationPoll = 20 * time.Millisecond
	other := New(zap.NewNop(), e.st, cfg)
	rctx, stop := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- other.RunOperations(rctx) }()
	defer func() {
		stop()
		if err := <-ran; err != nil {
			t.Error(err)
		}
	}()
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		op, err := e.st.OperationGet(ctx, id)
		return err == nil && op.State == store.OperationDone, fmt.Sprintf("%+v %v", op, err)
	}, "another instance ends the operation")
	done, _ := e.st.OperationGet(ctx, id)
	if done.Matched != 400 || done.Done != 400 || done.Skipped != 0 {
		t.Fatalf("after the takeover: matched %d done %d skipped %d, want 400 each acted on once", done.Matched, done.Done, done.Skipped)
	}
	if n := countJobs(t, e.st, `outcome = 'cancelled'`); n != 400 {
		t.Fatalf("%d jobs cancelled, want 400", n)
	}

	// DELETE: nothing more after the answer.
	oe := newAPIConfig(t, func(c *Config) { c.RequestTimeout, c.OperationBatch = 300*time.Millisecond, 1 }, token)
	if _, err := oe.st.JobsInsert(ctx, jobs); err != nil {
		t.Fatal(err)
	}
	code, out = oe.call("POST", "/v1/jobs/cancel", `{"filter": {"job_type": "t"}, "reason": "x"}`)
	if code != http.StatusAccepted {
		t.Fatalf("cancel: %d %v", code, out)
	}
	id = int64(operation(out)["id"].(float64))
	stopped := wantStopped(t, oe, id)
	if n := countJobs(t, oe.st, `outcome = 'cancelled'`); n != int(stopped.Done) || n == 400 {
		t.Fatalf("%d jobs cancelled when stopped, the operation says %d", n, stopped.Done)
	}
	testutil.Eventually(t, 10*time.Second, func() bool {
		oe.srv.ops.mu.Lock()
		defer oe.srv.ops.mu.Unlock()
		return len(oe.srv.ops.working) == 0
	}, "the worker returns")
	after, _ := oe.st.OperationGet(ctx, id)
	if n := countJobs(t, oe.st, `outcome = 'cancelled'`); after.Done != stopped.Done || !after.UpdatedAt.Equal(stopped.UpdatedAt) || n != int(stopped.Done) {
		t.Fatalf("after the stop: %+v and %d jobs cancelled; was %+v", after, n, stopped)
	}
}

// wantStopped stops an operation through the API and returns it as the
// store then has it.
func wantStopped(t *testing.T, e *apiEnv, id int64) store.Operation {
	t.Helper()
	if op := operation(e.want("DELETE", fmt.Sprintf("/v1/operations/%d", id), "", 200)); op["state"] != "stopped" {
		t.Fatalf("stop: %v", op)
	}
	op, err := e.st.OperationGet(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	e.want("DELETE", fmt.Sprintf("/v1/operations/%d", id), "", 200) // again: no error
	return op
}

func countJobs(t *testing.T, st *store.Store, where string) int {
	t.Helper()
	var n int
	if err := st.Pool().QueryRow(ctx, `SELECT count(*) FROM hipq_job WHERE `+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// decodeBulk, on any body: an input error with a code, or an operation
// with a filter, a reason, and a state and outcome its kind applies to.
func FuzzDecodeBulk(f *testing.F) {
	for _, s := range []string{`{"filter": {"queue": "q"}, "reason": "r"}`, `{"filter": {}, "reason": "r"}`, `{}`, `[]`, `null`,
		`{"filter": {"state": "final", "outcome": "failed", "created_after": "2026-01-01T00:00:00Z"}, "reason": "r", "dry_run": true}`,
		`{"filter": {"source": "intake", "reason_prefix": "no_job:"}, "reason": "r"}`, `{"filter": {"queue": 1}, "reason": "r"}`} {
		for k := range 4 {
			f.Add([]byte(s), k)
		}
	}
	kinds := []store.OperationKind{store.OperationCancel, store.OperationReplay, store.OperationRunNow, store.OperationDeadLetterReplay}
	f.Fuzz(func(t *testing.T, body []byte, k int) {
		kind := kinds[(k%4+4)%4]
		op, _, err := decodeBulk(body, kind)
		if err != nil {
			var ie *correlator.InputError
			if !errors.As(err, &ie) || ie.Code == "" {
				t.Fatalf("error %v is not an input error with a code", err)
			}
			return
		}
		if op.Kind != kind || op.Reason == "" || len(op.Reason) > 1000 {
			t.Fatalf("operation %+v from %q", op, body)
		}
		if kind.ForJobs() {
			f := op.Jobs
			if f == nil || *f == (store.JobFilter{}) {
				t.Fatalf("an empty job filter passed: %q", body)
			}
			if kind != store.OperationReplay && (f.State == correlator.StateFinal || f.Outcome != "") {
				t.Fatalf("%s of final jobs passed: %q", kind, body)
			}
			return
		}
		if op.DeadLetters == nil || *op.DeadLetters == (store.DeadLetterFilter{}) {
			t.Fatalf("an empty dead-letter filter passed: %q", body)
		}
	})
}

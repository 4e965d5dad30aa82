package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/api"
	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/certtest"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// hipq jobs, queues and dead-letters drive a real API server: tables by
// default, the API's JSON with --json, server and token from the
// environment or flags, API errors as exit 1 with the API's code, usage
// errors as exit 2.
func TestRemoteCommands(t *testing.T) {
	st := pgtest.New(t)
	token := strings.Repeat("k", 32)
	types := map[string]*correlator.JobType{"t": {Name: "t", Queue: "default", Timeout: time.Hour, Priority: 100,
		ThrottleFactor: 1, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}
	srv := httptest.NewServer(api.New(zaptest.NewLogger(t), st, api.Config{Tokens: []string{token}, Queues: []string{"default"},
		Types: types, CallbackSecret: []byte(strings.Repeat("s", 32))}).Handler())
	defer srv.Close()
	t.Setenv("HIPQ_API_URL", srv.URL)
	t.Setenv("HIPQ_API_TOKEN", token)
	for _, k := range []string{"k1", "k 2/x"} {
		j, err := correlator.NewJob(&correlator.Request{JobType: "t", JobKey: k, JobData: json.RawMessage(`{"n": 1}`)}, types["t"], time.Now())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.JobsInsert(context.Background(), []*correlator.Job{j}); err != nil {
			t.Fatal(err)
		}
	}

	// list: a table, paginated.
	out := runCLI(t, 0, "jobs", "list")
	mustContain(t, out, "ID", "STATE", "k1", "k 2/x", "initial")
	page1 := runCLI(t, 0, "jobs", "list", "--limit", "1")
	m := regexp.MustCompile(`more: add --cursor (\S+)`).FindStringSubmatch(page1)
	if m == nil || !strings.Contains(page1, "k 2/x") || strings.Contains(page1, "k1") {
		t.Fatalf("page 1:\n%s", page1)
	}
	page2 := runCLI(t, 0, "jobs", "list", "--limit", "1", "--cursor", m[1])
	if !strings.Contains(page2, "k1") || strings.Contains(page2, "more:") {
		t.Fatalf("page 2:\n%s", page2)
	}
	runCLI(t, 0, "jobs", "list", "--state", "final") // filters pass through
	mustContain(t, runCLI(t, 1, "jobs", "list", "--state", "bogus"), "400 invalid_parameter")

	// get: the job's columns, a key with a slash and a space escaped; --json
	// is the API's answer.
	mustContain(t, runCLI(t, 0, "jobs", "get", "t", "k 2/x"), "job", "t/k 2/x", "state", "initial", "no attempts yet", `{"n":1}`)
	var got struct {
		Job struct {
			JobKey string `json:"job_key"`
		} `json:"job"`
		Attempts []any `json:"attempts"`
	}
	if err := json.Unmarshal([]byte(runCLI(t, 0, "jobs", "get", "--json", "t", "k1")), &got); err != nil || got.Job.JobKey != "k1" || got.Attempts == nil {
		t.Fatalf("--json: %+v %v", got, err)
	}
	mustContain(t, runCLI(t, 1, "jobs", "get", "t", "nope"), "404 not_found")

	// cancel, then replay the final job.
	mustContain(t, runCLI(t, 0, "jobs", "cancel", "t", "k1"), "t/k1 cancelled", "final / cancelled")
	mustContain(t, runCLI(t, 1, "jobs", "cancel", "t", "k1"), "409 final")
	mustContain(t, runCLI(t, 0, "jobs", "replay", "t", "k1"), "replayed as a new job", "initial")

	// queues.
	mustContain(t, runCLI(t, 0, "queues", "pause", "default"), "queue default paused")
	if out := runCLI(t, 0, "queues", "resume", "default", "--json"); !strings.Contains(out, `"paused": false`) {
		t.Fatalf("resume --json:\n%s", out)
	}
	mustContain(t, runCLI(t, 1, "queues", "pause", "nope"), "404 not_found")

	// dead letters: list, replay.
	if err := st.DeadLetterInsert(context.Background(), []store.DeadLetter{{Kind: store.SourceIntake, Reason: "unknown_job_type: not yet",
		Source: store.Source{Topic: "jobs", Partition: 2, Offset: 40, Value: []byte(`{"job_type": "t", "job_key": "dl"}`), Received: time.Now()}}}); err != nil {
		t.Fatal(err)
	}
	out = runCLI(t, 0, "dead-letters", "list", "--source", "intake")
	mustContain(t, out, "SOURCE", "intake", "jobs/2@40", "unknown_job_type: not yet")
	id := regexp.MustCompile(`(?m)^(\d+)\s+intake`).FindStringSubmatch(out)
	if id == nil {
		t.Fatalf("no id in:\n%s", out)
	}
	mustContain(t, runCLI(t, 0, "dead-letters", "replay", id[1]), "replayed: accepted", "t/dl")
	mustContain(t, runCLI(t, 1, "dead-letters", "replay", id[1]), "409 already_replayed")

	// Server and token: flags win over the environment; errors say what.
	mustContain(t, runCLI(t, 1, "jobs", "list", "--token", strings.Repeat("x", 32)), "401 unauthorized")
	mustContain(t, runCLI(t, 1, "jobs", "list", "--server", "http://127.0.0.1:1"), "cannot reach the hipq API at http://127.0.0.1:1")
	mustContain(t, runCLI(t, 2, "jobs", "get", "t"), "want TYPE KEY")
	mustContain(t, runCLI(t, 2, "jobs", "frob"), "unknown subcommand")
	mustContain(t, runCLI(t, 2, "dead-letters", "replay", "x"), "not a dead letter id")
	mustContain(t, runCLI(t, 2, "queues"), "pause QUEUE")
}

// hipq jobs cancel|replay|run-now and hipq dead-letters replay with filter
// flags act on every job (dead letter) the filter matches, through the
// API: a dry run prints the count, an action its counts, one that
// outlasts the request is followed to its end; --reason is required, an
// empty filter is the API's 400, a TYPE KEY with filter flags is a usage
// error. hipq operations get and stop read and stop one.
func TestRemoteBulkCommands(t *testing.T) {
	st := pgtest.New(t)
	token := strings.Repeat("k", 32)
	types := map[string]*correlator.JobType{"t": {Name: "t", Queue: "default", Timeout: time.Hour, Priority: 100,
		ThrottleFactor: 1, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}
	s := api.New(zaptest.NewLogger(t), st, api.Config{Tokens: []string{token}, Queues: []string{"default"},
		Types: types, CallbackSecret: []byte(strings.Repeat("s", 32)), RequestTimeout: 400 * time.Millisecond, OperationBatch: 1})
	t.Cleanup(s.Close)
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	t.Setenv("HIPQ_API_URL", srv.URL)
	t.Setenv("HIPQ_API_TOKEN", token)
	var jobs []*correlator.Job
	for _, k := range []string{"k-1", "k-2", "k-3", "other"} {
		j, err := correlator.NewJob(&correlator.Request{JobType: "t", JobKey: k}, types["t"], time.Now())
		if err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, j)
	}
	if _, err := st.JobsInsert(context.Background(), jobs); err != nil {
		t.Fatal(err)
	}

	mustContain(t, runCLI(t, 0, "jobs", "cancel", "--key-prefix", "k-", "--reason", "tenant k left", "--dry-run"),
		"dry run of jobs.cancel: 3 match key_prefix=k- created_before=")
	mustContain(t, runCLI(t, 0, "jobs", "cancel", "--key-prefix", "k-", "--reason", "tenant k left"),
		"operation 1 jobs.cancel done: matched 3, done 3, skipped 0")
	var asJSON struct {
		Operation struct{ State, Kind string }
	}
	out := runCLI(t, 0, "jobs", "replay", "--key-prefix", "k-", "--state", "final", "--since", "1h", "--reason", "back", "--json")
	if err := json.Unmarshal([]byte(out), &asJSON); err != nil || asJSON.Operation.State != "done" || asJSON.Operation.Kind != "jobs.replay" {
		t.Fatalf("--json: %v %s", err, out)
	}
	mustContain(t, runCLI(t, 0, "operations", "get", "1"), "operation 1 jobs.cancel done")
	mustContain(t, runCLI(t, 1, "operations", "stop", "1"), "409 final")

	if err := st.DeadLetterInsert(context.Background(), []store.DeadLetter{{Kind: store.SourceIntake, Reason: "unknown_job_type: t",
		Source: store.Source{Value: []byte(`{"job_type": "t", "job_key": "dl"}`), Received: time.Now()}}}); err != nil {
		t.Fatal(err)
	}
	mustContain(t, runCLI(t, 0, "dead-letters", "replay", "--source", "intake", "--since", "1h", "--reason", "t is configured"),
		"dead_letters.replay done: matched 1, done 1, skipped 0", "source=intake")

	// An operation that outlasts the request is followed to its end.
	var many []*correlator.Job
	for i := range 300 {
		j, _ := correlator.NewJob(&correlator.Request{JobType: "t", JobKey: fmt.Sprintf("m-%03d", i)}, types["t"], time.Now())
		many = append(many, j)
	}
	if _, err := st.JobsInsert(context.Background(), many); err != nil {
		t.Fatal(err)
	}
	mustContain(t, runCLI(t, 0, "jobs", "cancel", "--key-prefix", "m-", "--reason", "too many"), "done: matched 300, done 300, skipped 0")

	mustContain(t, runCLI(t, 2, "jobs", "cancel", "--key-prefix", "k-"), "--reason is required")
	mustContain(t, runCLI(t, 1, "jobs", "cancel", "--reason", "x"), "400 empty_filter")
	mustContain(t, runCLI(t, 2, "jobs", "cancel", "t", "k-1", "--queue", "default"), "want TYPE KEY for one job, or filter flags")
	mustContain(t, runCLI(t, 2, "jobs", "run-now", "t", "k-1"), "want TYPE KEY for one job, or filter flags")
	// The connection's flags are no filter: one job (none such here), with
	// the CA file given.
	mustContain(t, runCLI(t, 1, "jobs", "cancel", "--ca-file", certtest.NewCA(t, "api").File, "t", "nobody"), "404")
	mustContain(t, runCLI(t, 2, "jobs", "cancel", "--since", "yesterday", "--reason", "x"), "neither an RFC 3339 time nor a duration")
	mustContain(t, runCLI(t, 2, "dead-letters", "replay", "3", "--source", "intake"), "want ID for one dead letter, or filter flags")
	mustContain(t, runCLI(t, 2, "operations", "get", "x"), "not an operation id")
	if j, err := st.JobGet(context.Background(), "t", "other"); err != nil || j.State != correlator.StateInitial {
		t.Fatalf("a job outside every filter: %v %v", j, err)
	}
}

// runCLI runs hipq with args and wants exit code wantCode; it returns
// what hipq printed (stdout, then stderr).
func runCLI(t *testing.T, wantCode int, args ...string) string {
	t.Helper()
	var out, errOut bytes.Buffer
	if code := runMain(args, &out, &errOut); code != wantCode {
		t.Fatalf("hipq %s: exit %d, want %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), code, wantCode, out.String(), errOut.String())
	}
	return out.String() + errOut.String()
}

// mustContain wants every one of parts in out.
func mustContain(t *testing.T, out string, parts ...string) {
	t.Helper()
	for _, p := range parts {
		if !strings.Contains(out, p) {
			t.Fatalf("output lacks %q:\n%s", p, out)
		}
	}
}

package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// customMatcher reads replies of the "custom" topic from the value.
func customMatcher() correlator.Matcher {
	m := correlator.DefaultMatcher()
	m.JobType, m.JobKey, m.Status = correlator.Field{JSON: "/kind"}, correlator.Field{JSON: "/ref"}, correlator.Field{JSON: "/state"}
	m.Success = []string{"done"}
	return m
}

var (
	ctx    = context.Background()
	token  = strings.Repeat("t", 32)
	secret = []byte(strings.Repeat("s", 32))
)

type apiEnv struct {
	t     *testing.T
	st    *store.Store
	url   string
	token string
	m     *metrics.Metrics
	h     http.Handler
	srv   *Server
	cfg   Config
}

func newAPI(t *testing.T, tokens ...string) *apiEnv {
	t.Helper()
	return newAPIWith(t, nil, tokens...)
}

func newAPIWith(t *testing.T, copies *deadletter.Copier, tokens ...string) *apiEnv {
	t.Helper()
	return newAPIConfig(t, func(c *Config) { c.DeadLetters = copies }, tokens...)
}

// newAPIConfig is newAPI with set changing the server's config.
func newAPIConfig(t *testing.T, set func(*Config), tokens ...string) *apiEnv {
	t.Helper()
	return newAPILogged(t, zaptest.NewLogger(t), set, tokens...)
}

// newAPILogged is newAPIConfig logging to log.
func newAPILogged(t *testing.T, log *zap.Logger, set func(*Config), tokens ...string) *apiEnv {
	t.Helper()
	st := pgtest.New(t)
	types := map[string]*correlator.JobType{
		"t": {Name: "t", Queue: "default", Timeout: time.Hour, Priority: 100, ThrottleFactor: 1, Delivery: correlator.AtLeastOnce,
			Retry: &correlator.Backoff{Attempts: 3, Initial: time.Minute, When: []correlator.AttemptOutcome{correlator.AttemptFailed}}},
	}
	m := metrics.New()
	cfg := Config{Tokens: tokens, CallbackSecret: secret, MaxBodyBytes: 4096,
		Queues: []string{"default"}, Types: types, EarlyTTL: time.Minute, Metrics: m,
		Matchers: map[string]correlator.Matcher{"custom": customMatcher()}}
	set(&cfg)
	s := New(log, st, cfg)
	t.Cleanup(s.Close) // (before the database goes: it may work bulk operations)
	// Every request the tests make, and its answer, is checked against
	// api/openapi.yaml.
	h := validating(t, s.Handler())
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	e := &apiEnv{t: t, st: st, url: srv.URL, m: m, h: h, srv: s, cfg: cfg}
	if len(tokens) > 0 {
		e.token = tokens[0]
	}
	return e
}

// call makes a request and decodes the JSON answer.
func (e *apiEnv) call(method, path, body string) (int, map[string]any) {
	e.t.Helper()
	req, err := http.NewRequest(method, e.url+path, strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	if e.token != "" {
		req.Header.Set("Authorization", "Bearer "+e.token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out map[string]any
	if len(raw) > 0 && json.Unmarshal(raw, &out) != nil {
		e.t.Fatalf("%s %s: answer is not JSON: %s", method, path, raw)
	}
	if resp.StatusCode >= 400 && resp.Header.Get("Content-Type") != "application/json" {
		e.t.Fatalf("%s %s: error without a JSON content type", method, path)
	}
	return resp.StatusCode, out
}

func (e *apiEnv) want(method, path, body string, status int) map[string]any {
	e.t.Helper()
	got, out := e.call(method, path, body)
	if got != status {
		e.t.Fatalf("%s %s: status %d, want %d: %v", method, path, got, status, out)
	}
	return out
}

func errCode(out map[string]any) string {
	e, _ := out["error"].(map[string]any)
	c, _ := e["code"].(string)
	if m, _ := e["message"].(string); c == "" || m == "" {
		return "(no code or message)"
	}
	return c
}

func job(out map[string]any) map[string]any { j, _ := out["job"].(map[string]any); return j }

func TestAuth(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	e.want("PUT", "/v1/jobs/t/k1", `{}`, 201)
	e.token = ""
	if out := e.want("GET", "/v1/jobs/t/k1", "", 401); errCode(out) != "unauthorized" {
		t.Fatalf("no token: %v", out)
	}
	e.token = strings.Repeat("x", 32)
	e.want("GET", "/v1/jobs/t/k1", "", 401)
	e.want("POST", "/v1/queues/default/pause", "", 401)
	e.want("GET", "/v1/dead-letters", "", 401)
	e.token = ""
	e.want("GET", "/healthz", "", 200) // no token needed
	e.want("GET", "/readyz", "", 200)

	open := newAPI(t) // no tokens: no auth
	open.want("PUT", "/v1/jobs/t/k1", `{}`, 201)
	open.want("GET", "/v1/jobs/t/k1", "", 200)
}

func TestLoopbackOnly(t *testing.T) {
	for in, want := range map[string]string{
		"0.0.0.0:8080": "127.0.0.1:8080", ":9000": "127.0.0.1:9000", "10.1.2.3:80": "127.0.0.1:80",
		"127.0.0.1:8080": "127.0.0.1:8080", "localhost:1": "localhost:1", "[::1]:8080": "[::1]:8080",
	} {
		if got := loopbackOnly(in); got != want {
			t.Errorf("loopbackOnly(%q) = %q, want %q", in, got, want)
		}
	}
}

// PUT: 201 new, 200 same data, 409 other data, a new job once the key's
// jobs are final; bad input is refused with its reason.
func TestEnqueue(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	out := e.want("PUT", "/v1/jobs/t/a%2Fb", `{"job_data": {"x": 1}, "priority": 5}`, 201)
	j := job(out)
	if j["job_key"] != "a/b" || j["state"] != "initial" || j["priority"] != 5.0 || j["error"] != "NONE" || j["outcome"] != nil {
		t.Fatalf("job %v", j)
	}
	if again := job(e.want("PUT", "/v1/jobs/t/a%2Fb", `{"job_data": {"x": 1}}`, 200)); again["id"] != j["id"] {
		t.Fatalf("same data made another job: %v", again)
	}
	if out := e.want("PUT", "/v1/jobs/t/a%2Fb", `{"job_data": {"x": 2}}`, 409); errCode(out) != "conflict" {
		t.Fatalf("%v", out)
	}
	for body, code := range map[string]string{
		`{"job_data": 1, "prority": 5}`:          "unknown_field",
		`{"job_type": "t"}`:                      "unknown_field",
		`[1]`:                                    "not_object",
		`{"priority": "high"}`:                   "invalid_field",
		`{"job_data": "a\u0000b"}`:               "null_character",
		`{{`:                                     "invalid_json",
		`{"time_windows": [{"start": "25:00"}]}`: "invalid_field",
	} {
		if out := e.want("PUT", "/v1/jobs/t/bad", body, 400); errCode(out) != code {
			t.Errorf("body %s: code %s, want %s", body, errCode(out), code)
		}
	}
	if out := e.want("PUT", "/v1/jobs/t/big", `{"job_data": "`+strings.Repeat("x", 5000)+`"}`, 413); errCode(out) != "too_large" {
		t.Fatalf("%v", out)
	}
	if out := e.want("PUT", "/v1/jobs/t/%FF", `{}`, 400); errCode(out) != "invalid_utf8" {
		t.Fatalf("invalid UTF-8 key: %v", out)
	}
	if out := e.want("GET", "/v1/jobs/t/a%00b", ``, 400); errCode(out) != "null_character" {
		t.Fatalf("NUL in key: %v", out)
	}
	if out := e.want("PUT", "/v1/jobs/nope/k", `{}`, 404); errCode(out) != "unknown_job_type" {
		t.Fatalf("%v", out)
	}
	e.want("POST", "/v1/jobs/t/a%2Fb/cancel", "", 200)
	if n := job(e.want("PUT", "/v1/jobs/t/a%2Fb", `{"job_data": {"x": 2}}`, 201)); n["id"] == j["id"] {
		t.Fatal("a key whose jobs are final did not make a new job")
	}
}

// GET one job with its attempts; the non-final job wins over final ones.
func TestGetJob(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	e.want("GET", "/v1/jobs/t/none", "", 404)
	e.want("PUT", "/v1/jobs/t/k", `{"job_data": {"v": 1}}`, 201)
	if _, err := e.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 10, Instance: "i1"}); err != nil {
		t.Fatal(err)
	}
	out := e.want("GET", "/v1/jobs/t/k", "", 200)
	atts, _ := out["attempts"].([]any)
	if job(out)["state"] != "running" || len(atts) != 1 || atts[0].(map[string]any)["instance"] != "i1" {
		t.Fatalf("%v", out)
	}
	e.want("POST", "/v1/jobs/t/k/cancel", "", 200)
	e.want("POST", "/v1/jobs/t/k/replay", "", 201)
	out = e.want("GET", "/v1/jobs/t/k", "", 200)
	if job(out)["state"] != "initial" || len(out["attempts"].([]any)) != 0 {
		t.Fatalf("the replayed (non-final) job should be shown: %v", out)
	}
}

// List: newest first, filters, and keyset pagination over several pages.
func TestListJobs(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	for i := range 7 {
		e.want("PUT", fmt.Sprintf("/v1/jobs/t/k%d", i), `{}`, 201)
	}
	e.want("POST", "/v1/jobs/t/k3/cancel", "", 200)
	var keys []string
	cursor := ""
	pages := 0
	for {
		out := e.want("GET", "/v1/jobs?job_type=t&limit=3"+cursor, "", 200)
		pages++
		for _, j := range out["jobs"].([]any) {
			keys = append(keys, j.(map[string]any)["job_key"].(string))
		}
		next, _ := out["next_cursor"].(string)
		if next == "" {
			break
		}
		cursor = "&cursor=" + next
	}
	if got := strings.Join(keys, ","); got != "k6,k5,k4,k3,k2,k1,k0" || pages != 3 {
		t.Fatalf("%d pages: %s", pages, got)
	}
	out := e.want("GET", "/v1/jobs?state=final", "", 200)
	if l := out["jobs"].([]any); len(l) != 1 || l[0].(map[string]any)["job_key"] != "k3" {
		t.Fatalf("state filter: %v", out)
	}
	if l := e.want("GET", "/v1/jobs?queue=other", "", 200)["jobs"].([]any); len(l) != 0 {
		t.Fatalf("queue filter: %v", l)
	}
	for _, q := range []string{"limit=0", "limit=x", "limit=1001", "cursor=abc", "state=done", "colour=red"} {
		if out := e.want("GET", "/v1/jobs?"+q, "", 400); errCode(out) != "invalid_parameter" {
			t.Errorf("%s: %v", q, out)
		}
	}
}

func TestCancelAndReplay(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	e.want("POST", "/v1/jobs/t/none/cancel", "", 404)
	e.want("POST", "/v1/jobs/t/none/replay", "", 404)
	e.want("PUT", "/v1/jobs/t/k", `{"job_data": {"v": 1}}`, 201)
	if out := e.want("POST", "/v1/jobs/t/k/replay", "", 409); errCode(out) != "conflict" {
		t.Fatalf("%v", out)
	}
	if _, err := e.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 10, Instance: "i"}); err != nil {
		t.Fatal(err)
	}
	j := job(e.want("POST", "/v1/jobs/t/k/cancel", "", 200))
	if j["state"] != "final" || j["outcome"] != "cancelled" || j["error"] != "cancelled" {
		t.Fatalf("%v", j)
	}
	var attOutcome string
	_ = e.st.Pool().QueryRow(ctx, "SELECT outcome FROM hipq_attempt").Scan(&attOutcome)
	if attOutcome != "cancelled" {
		t.Fatalf("running attempt outcome %q, want cancelled", attOutcome)
	}
	if out := e.want("POST", "/v1/jobs/t/k/cancel", "", 409); errCode(out) != "final" {
		t.Fatalf("%v", out)
	}
	n := job(e.want("POST", "/v1/jobs/t/k/replay", "", 201))
	if n["id"] == j["id"] || n["state"] != "initial" || n["attempt"] != 0.0 || fmt.Sprint(n["job_data"]) != "map[v:1]" {
		t.Fatalf("replayed %v", n)
	}
	e.want("POST", "/v1/jobs/nope/k/replay", "", 404)
}

func TestQueuesPauseResume(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	out := e.want("POST", "/v1/queues/default/pause", "", 200)
	if out["queue"] != "default" || out["paused"] != true {
		t.Fatalf("%v", out)
	}
	e.want("PUT", "/v1/jobs/t/k", `{}`, 201)
	if c, _ := e.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 10, Instance: "i"}); len(c.Jobs) != 0 {
		t.Fatal("a paused queue was claimed")
	}
	if out := e.want("POST", "/v1/queues/default/resume", "", 200); out["paused"] != false {
		t.Fatalf("%v", out)
	}
	if c, _ := e.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 10, Instance: "i"}); len(c.Jobs) != 1 {
		t.Fatal("a resumed queue was not claimed")
	}
	if out := e.want("POST", "/v1/queues/nowhere/pause", "", 404); errCode(out) != "not_found" {
		t.Fatalf("%v", out)
	}
}

func TestDeadLetters(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	var dls []store.DeadLetter
	for i := range 5 {
		kind := store.SourceIntake
		if i%2 == 1 {
			kind = store.SourceReply
		}
		dls = append(dls, store.DeadLetter{Kind: kind, Reason: fmt.Sprintf("invalid_json: %d", i),
			Source: store.Source{Topic: "jobs", Offset: int64(i), Value: []byte("{{"), Received: time.Now(),
				Headers: []correlator.Header{{Key: "h", Value: []byte("v")}}}})
	}
	if err := e.st.DeadLetterInsert(ctx, dls); err != nil {
		t.Fatal(err)
	}
	var reasons []string
	cursor := ""
	for {
		out := e.want("GET", "/v1/dead-letters?source=intake&limit=2"+cursor, "", 200)
		for _, d := range out["dead_letters"].([]any) {
			m := d.(map[string]any)
			reasons = append(reasons, m["reason"].(string))
			if m["record_value"] != "e3s=" || m["headers"].([]any)[0].(map[string]any)["value"] != "dg==" {
				t.Fatalf("dead letter %v", m)
			}
		}
		next, _ := out["next_cursor"].(string)
		if next == "" {
			break
		}
		cursor = "&cursor=" + next
	}
	if got := strings.Join(reasons, ","); got != "invalid_json: 4,invalid_json: 2,invalid_json: 0" {
		t.Fatalf("%s", got)
	}
	e.want("GET", "/v1/dead-letters?source=kafka", "", 400)
}

func TestHealth(t *testing.T) {
	t.Parallel()
	e := newAPI(t)
	if out := e.want("GET", "/readyz", "", 200); out["ready"] != true {
		t.Fatalf("%v", out)
	}
	st := e.st
	s := New(zaptest.NewLogger(t), st, Config{Ready: func(context.Context) error { return errors.New("no broker reachable") }})
	srv := httptest.NewServer(validating(t, s.Handler()))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(body), "no broker reachable") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if out := e.want("GET", "/v1/nothing", "", 404); errCode(out) != "not_found" {
		t.Fatalf("%v", out)
	}
}

// /readyz is 503 while a PostgreSQL write runs past the write deadline
// (here a cancel blocked by a row lock), and ready again once it ends.
func TestReadyWhileWritesStall(t *testing.T) {
	t.Parallel()
	e := newAPI(t)
	e.want("PUT", "/v1/jobs/t/locked", `{}`, 201)
	srv := httptest.NewServer(validating(t, New(zaptest.NewLogger(t), e.st, Config{WriteDeadline: 100 * time.Millisecond}).Handler()))
	defer srv.Close()
	ready := func() (int, string) {
		resp, err := http.Get(srv.URL + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	tx, err := e.st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }() // (a failed check leaves it open)
	if _, err := tx.Exec(ctx, "SELECT 1 FROM hipq_job WHERE queue = 'default' AND job_key = 'locked' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := e.st.JobCancel(ctx, "t", "locked"); done <- err }()
	waitFor := func(want int, what string) string {
		t.Helper()
		var body string
		testutil.Eventually(t, 10*time.Second, func() (bool, string) {
			var code int
			code, body = ready()
			return code == want, fmt.Sprintf("readyz %d %s", code, body)
		}, "%s", what)
		return body
	}
	if body := waitFor(503, "a stalled write"); !strings.Contains(body, "a PostgreSQL write has been running") {
		t.Fatalf("503 without the reason: %s", body)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitFor(200, "writes done")
}

// running inserts a job and claims it: attempt 1 running.
func (e *apiEnv) running(key string) int64 {
	e.t.Helper()
	e.want("PUT", "/v1/jobs/t/"+url.PathEscape(key), `{}`, 201)
	c, err := e.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 100, Instance: "i"})
	if err != nil || len(c.Jobs) != 1 {
		e.t.Fatalf("claim: %v %v", c, err)
	}
	return c.Jobs[0].ID
}

func signed(id int64, key string, attempt int) string {
	return correlator.CallbackURL("", secret, id, "t", key, attempt)
}

// The callback endpoint (SPEC §6): a valid signature applies the reply; a
// tampered one is refused and changes nothing; an old attempt is stale; a
// reply before dispatch is early; a newer attempt is dead-lettered.
func TestCallback(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	id := e.running("k1")
	id2 := e.running("k2")
	e.token = "" // the signature alone authorizes
	u := signed(id, "k1", 1)
	tampered := strings.Replace(u, "attempt=1", "attempt=2", 1)
	if out := e.want("POST", tampered, `{"status": "succeeded"}`, 401); errCode(out) != "unauthorized" {
		t.Fatalf("%v", out)
	}
	sigless := strings.Split(u, "&sig=")[0]
	e.want("POST", sigless, `{"status": "succeeded"}`, 401)
	if j, _ := e.st.JobGet(ctx, "t", "k1"); j.State != correlator.StateRunning {
		t.Fatalf("a refused callback changed the job: %s", j.State)
	}
	e.want("POST", u, `{"status": "succeeded", "bogus": 1}`, 400)
	e.want("POST", u, `{"status": "maybe"}`, 400)
	if out := e.want("POST", u, `{"status": "succeeded", "result": {"tracking": "T1"}}`, 200); out["applied"] != true {
		t.Fatalf("%v", out)
	}
	j, _ := e.st.JobGet(ctx, "t", "k1")
	if j.Outcome != correlator.OutcomeSucceeded || string(j.Result) != `{"tracking": "T1"}` {
		t.Fatalf("job %s %s", j.Outcome, j.Result)
	}
	if out := e.want("POST", u, `{"status": "succeeded"}`, 200); out["applied"] != false || out["reason"] != "duplicate" {
		t.Fatalf("%v", out)
	}

	// Attempt 1 failed and was retried; a late callback of attempt 1 is stale.
	e.want("POST", signed(id2, "k2", 1), `{"status": "failed", "error": "out of stock"}`, 200)
	if j, _ := e.st.JobGet(ctx, "t", "k2"); j.State != correlator.StateRetry || j.Error != "out of stock" {
		t.Fatalf("k2 %s %q", j.State, j.Error)
	}
	if out := e.want("POST", signed(id2, "k2", 1), `{"status": "succeeded"}`, 200); out["reason"] != "stale" {
		t.Fatalf("%v", out)
	}
	// A newer attempt than the job's is dead-lettered: 422.
	if out := e.want("POST", signed(id2, "k2", 5), `{"status": "succeeded"}`, 422); errCode(out) != "dead_lettered" {
		t.Fatalf("%v", out)
	}
	var n int
	_ = e.st.Pool().QueryRow(ctx, "SELECT count(*) FROM hipq_dead_letter WHERE source = 'callback' AND reason LIKE 'newer_attempt:%'").Scan(&n)
	if n != 1 {
		t.Fatalf("%d callback dead letters", n)
	}

	// Token instead of signature; a reply before dispatch is early.
	e.token = token
	e.want("PUT", "/v1/jobs/t/k3", `{}`, 201)
	if out := e.want("POST", "/v1/jobs/t/k3/response", `{"status": "succeeded"}`, 202); out["reason"] != "early" {
		t.Fatalf("%v", out)
	}
	e.token = strings.Repeat("y", 32)
	e.want("POST", "/v1/jobs/t/k3/response", `{"status": "succeeded"}`, 401)
}

// Issue 30.5: a callback PostgreSQL refuses for a reason that is not its
// data (here a trigger failing on every update of hipq_job) answers 503
// naming the SQLSTATE, and is never dead-lettered: the caller keeps the
// reply and tries again, and once the error stops it applies.
func TestCallbackRefusedByTheSystemIs503(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	e := newAPI(t)
	id := e.running("k1")
	if _, err := e.st.Pool().Exec(ctx, `
		CREATE FUNCTION refuse_all() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'trigger bug' USING ERRCODE = 'XX000'; END $$;
		CREATE TRIGGER refuse_all BEFORE UPDATE ON hipq_job FOR EACH ROW EXECUTE FUNCTION refuse_all();`); err != nil {
		t.Fatal(err)
	}
	out := e.want("POST", signed(id, "k1", 1), `{"status": "succeeded"}`, 503)
	if msg, _ := out["error"].(map[string]any)["message"].(string); errCode(out) != "unavailable" || !strings.Contains(msg, "XX000") {
		t.Fatalf("503 without the SQLSTATE: %v", out)
	}
	var n int
	if err := e.st.Pool().QueryRow(ctx, "SELECT count(*) FROM hipq_dead_letter").Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d dead letters: %v", n, err)
	}
	if _, err := e.st.Pool().Exec(ctx, `DROP TRIGGER refuse_all ON hipq_job`); err != nil {
		t.Fatal(err)
	}
	if out := e.want("POST", signed(id, "k1", 1), `{"status": "succeeded"}`, 200); out["applied"] != true {
		t.Fatalf("%v", out)
	}
}

// /readyz fails naming the consumers that wait on a refusal that is not
// their records' own.
func TestReadyNamesStalledConsumers(t *testing.T) {
	t.Parallel()
	e := newAPIConfig(t, func(c *Config) {
		c.Stalled = func() error { return errors.New("hipq-intake stalled: SQLSTATE 42501") }
	})
	out := e.want("GET", "/readyz", "", 503)
	if checks, _ := out["checks"].(map[string]any); checks["consumers"] != "hipq-intake stalled: SQLSTATE 42501" || out["ready"] != false {
		t.Fatalf("%v", out)
	}
	e = newAPIConfig(t, func(c *Config) { c.Stalled = func() error { return nil } })
	if out := e.want("GET", "/readyz", "", 200); out["checks"].(map[string]any)["consumers"] != "ok" {
		t.Fatalf("%v", out)
	}
}

func FuzzDecodeEnqueue(f *testing.F) {
	for _, s := range []string{`{}`, ``, `{"job_data": {"a": [1, 2]}, "priority": 3}`, `{"job_type": "x"}`, `[]`, `{"time_windows": [{"start": "01:00", "end": "02:00", "tz": "UTC"}]}`, `{"expires_at": "2026-01-01T00:00:00Z"}`} {
		f.Add([]byte(s), "t", "k")
	}
	f.Fuzz(func(t *testing.T, body []byte, typ, key string) {
		r, err := decodeEnqueue(body, typ, key, 4096)
		if err != nil {
			var ie *correlator.InputError
			if !errors.As(err, &ie) || ie.Code == "" {
				t.Fatalf("error %v is not an input error with a code", err)
			}
			return
		}
		if r.JobType != typ || r.JobKey != key {
			t.Fatalf("type/key %q/%q, want the URL's %q/%q", r.JobType, r.JobKey, typ, key)
		}
	})
}

func FuzzDecodeCallback(f *testing.F) {
	for _, s := range []string{`{"status": "succeeded"}`, `{"status": "failed", "retryable": false, "error": "x", "attempt": 2, "result": [1]}`, `{}`, `{"status": 1}`, `null`} {
		f.Add([]byte(s), int64(7), 2)
	}
	f.Fuzz(func(t *testing.T, body []byte, id int64, attempt int) {
		var at *int
		if attempt > 0 {
			at = &attempt
		}
		r, err := decodeCallback(body, "t", "k", &id, at, 4096)
		if err != nil {
			var ie *correlator.InputError
			if !errors.As(err, &ie) || ie.Code == "" {
				t.Fatalf("error %v is not an input error with a code", err)
			}
			return
		}
		if *r.JobID != id || (at != nil && *r.Attempt != attempt) || !json.Valid(r.Result) {
			t.Fatalf("reply %+v", r)
		}
	})
}

// POST /v1/dead-letters/{id}/replay sends a dead letter through its path
// again: 202 with replayed_at set in the same transaction as the effect;
// 422 and nothing changed when it is refused again; 409 for a second
// replay or a conflicting job; 404 for no such dead letter.
func TestDeadLetterReplay(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	dl := func(kind, topic, value string, hs ...correlator.Header) int64 {
		t.Helper()
		if err := e.st.DeadLetterInsert(ctx, []store.DeadLetter{{Kind: kind, Reason: "unknown_job_type: test",
			Source: store.Source{Topic: topic, Value: []byte(value), Headers: hs, Received: time.Now()}}}); err != nil {
			t.Fatal(err)
		}
		var id int64
		_ = e.st.Pool().QueryRow(ctx, "SELECT max(id) FROM hipq_dead_letter").Scan(&id)
		return id
	}
	replayed := func(id int64) bool {
		d, err := e.st.DeadLetterGet(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return d.Replayed != nil
	}
	path := func(id int64) string { return fmt.Sprintf("/v1/dead-letters/%d/replay", id) }

	// Intake: a record of a type this instance did not know then is a job now.
	in := dl(store.SourceIntake, "jobs", `{"job_type": "t", "job_key": "late", "job_data": {"n": 1}}`)
	out := e.want("POST", path(in), "", 202)
	if out["result"] != "accepted" || job(out)["job_key"] != "late" || !replayed(in) {
		t.Fatalf("intake replay: %v", out)
	}
	if j, err := e.st.JobGet(ctx, "t", "late"); err != nil || string(j.JobData) != `{"n": 1}` {
		t.Fatalf("replayed job: %v %v", j, err)
	}
	if out := e.want("POST", path(in), "", 409); errCode(out) != "already_replayed" {
		t.Fatalf("second replay: %v", out)
	}
	// Still bad: 422, nothing changes.
	bad := dl(store.SourceIntake, "jobs", `{{{`)
	if out := e.want("POST", path(bad), "", 422); errCode(out) != "still_refused" || !strings.Contains(out["error"].(map[string]any)["message"].(string), "invalid_json") {
		t.Fatalf("bad record: %v", out)
	}
	// A non-final job of the key with other data: 409, nothing changes.
	other := dl(store.SourceIntake, "jobs", `{"job_type": "t", "job_key": "late", "job_data": {"n": 2}}`)
	e.want("POST", path(other), "", 409)
	if replayed(bad) || replayed(other) {
		t.Fatal("a refused replay set replayed_at")
	}
	e.want("POST", "/v1/jobs/t/late/cancel", "", 200) // out of the claims below

	// A Kafka reply, read with its topic's matcher, resolves its job.
	e.running("kr")
	rep := dl(store.SourceReply, "custom", `{"kind": "t", "ref": "kr", "state": "done", "v": 7}`)
	if out := e.want("POST", path(rep), "", 202); out["result"] != "applied" || !replayed(rep) {
		t.Fatalf("reply replay: %v", out)
	}
	if j, _ := e.st.JobGet(ctx, "t", "kr"); j.Outcome != correlator.OutcomeSucceeded {
		t.Fatalf("kr: %s %s", j.State, j.Outcome)
	}

	// A callback for attempt 2 came while the job was at attempt 1
	// (newer_attempt); once attempt 2 runs, the replay applies it.
	id := e.running("kc")
	e.want("POST", signed(id, "kc", 2), `{"status": "succeeded", "result": {"x": 1}}`, 422)
	var cb int64
	_ = e.st.Pool().QueryRow(ctx, "SELECT id FROM hipq_dead_letter WHERE source = 'callback'").Scan(&cb)
	if out := e.want("POST", path(cb), "", 422); errCode(out) != "still_refused" || replayed(cb) {
		t.Fatalf("callback replayed too soon: %v", out)
	}
	if _, err := e.st.Pool().Exec(ctx, "UPDATE hipq_job SET state = 'retry', scheduled_run_time = now() WHERE id = $1", id); err != nil {
		t.Fatal(err)
	}
	if c, err := e.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 10, Instance: "i"}); err != nil || len(c.Jobs) != 1 || c.Jobs[0].Attempt != 2 {
		t.Fatalf("claim attempt 2: %v %v", c, err)
	}
	if out := e.want("POST", path(cb), "", 202); out["result"] != "applied" {
		t.Fatalf("callback replay: %v", out)
	}
	if j, _ := e.st.JobGet(ctx, "t", "kc"); j.Outcome != correlator.OutcomeSucceeded || j.Attempt != 2 || string(j.Result) != `{"x": 1}` {
		t.Fatalf("kc: %s %s attempt %d %s", j.State, j.Outcome, j.Attempt, j.Result)
	}
	var dead int
	_ = e.st.Pool().QueryRow(ctx, "SELECT count(*) FROM hipq_dead_letter").Scan(&dead)
	if dead != 5 {
		t.Fatalf("%d dead letters: a refused replay must not add one", dead)
	}

	e.want("POST", "/v1/dead-letters/99999/replay", "", 404)
	e.want("POST", "/v1/dead-letters/x/replay", "", 400)
	e.token = ""
	e.want("POST", path(rep), "", 401)

	accepted, _ := e.m.Value("hipq_intake_records_total", map[string]string{"source": "replay", "result": "accepted"})
	applied, _ := e.m.Value("hipq_replies_total", map[string]string{"source": "replay", "result": "applied"})
	if accepted != 1 || applied != 2 {
		t.Fatalf("metrics: %v intake replays accepted, %v replies applied; want 1, 2", accepted, applied)
	}
}

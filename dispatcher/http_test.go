package dispatcher_test

import (
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/certtest"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/tlsconf"
	"github.com/hipq/hipq/store"
)

var secret = []byte(strings.Repeat("k", 32))

// downstream is an httptest server whose answers a test scripts per call.
type downstream struct {
	*httptest.Server
	mu    sync.Mutex
	calls []*http.Request
	// answer returns status and body for the n-th call (1-based) of a key.
	answer func(key string, n int) (int, string)
	seen   map[string]int
}

func newDownstream(t *testing.T, answer func(key string, n int) (int, string)) *downstream {
	d := &downstream{answer: answer, seen: map[string]int{}}
	d.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		d.mu.Lock()
		d.calls = append(d.calls, r)
		key := r.Header.Get("Hipq-Job-Key")
		d.seen[key]++
		n := d.seen[key]
		d.mu.Unlock()
		status, out := d.answer(key, n)
		if status == 0 { // hang until the client gives up
			<-r.Context().Done()
			return
		}
		w.WriteHeader(status)
		_, _ = io.WriteString(w, out)
	}))
	t.Cleanup(d.Close)
	return d
}

func (d *downstream) callCount(key string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.seen[key]
}

type httpCase struct {
	t     *testing.T
	st    *store.Store
	d     *dispatcher.Dispatcher
	m     *metrics.Metrics
	types map[string]*correlator.JobType
}

// newHTTPCase serves types "async", "sync" (retry 3 attempts, fixed 1ms)
// and "amo" (sync, at_most_once, same retry) on url.
func newHTTPCase(t *testing.T, target string, timeout time.Duration) *httpCase {
	return newHTTPCaseOn(t, pgtest.New(t), target, timeout)
}

func newHTTPCaseOn(t *testing.T, st *store.Store, target string, timeout time.Duration) *httpCase {
	retry := &correlator.Backoff{Attempts: 3, Initial: time.Millisecond,
		When: []correlator.AttemptOutcome{correlator.AttemptFailed, correlator.AttemptDispatchError}}
	types := map[string]*correlator.JobType{
		"async": {Name: "async", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: retry},
		"sync":  {Name: "sync", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: retry},
		"amo":   {Name: "amo", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtMostOnce, Retry: retry},
	}
	routes := map[string]dispatcher.HTTPRoute{
		"async": {URL: target + "/calls/{job_type}/{job_key}", Headers: map[string]string{"X-Api-Key": "k1"}, Timeout: timeout},
		"sync":  {URL: target + "/calls/{job_type}/{job_key}", Method: http.MethodPut, Timeout: timeout, Sync: true},
		"amo":   {URL: target + "/calls/{job_type}/{job_key}", Timeout: timeout, Sync: true, Delivery: correlator.AtMostOnce},
	}
	s := dispatcher.NewHTTPSender(dispatcher.HTTPSenderConfig{Routes: routes, PublicURL: "https://hipq.example", CallbackSecret: secret})
	senders := map[string]dispatcher.Sender{"async": s, "sync": s, "amo": s}
	m := metrics.New()
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 50,
		Queues: []dispatcher.QueueConfig{{Name: "default"}}, Types: types, Senders: senders, Metrics: m})
	return &httpCase{t: t, st: st, d: d, m: m, types: types}
}

func (c *httpCase) insert(typ, key string) {
	c.t.Helper()
	j := &correlator.Job{Queue: "default", JobType: typ, JobKey: key, JobData: json.RawMessage(`{"n": 1}`), MaxAttempts: 3,
		Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)}
	if _, err := c.st.JobsInsert(ctx, []*correlator.Job{j}); err != nil {
		c.t.Fatal(err)
	}
}

// settle runs dispatch rounds until the job is final or waits in initial
// (or the deadline passes), and returns it.
func (c *httpCase) settle(typ, key string) *correlator.Job {
	c.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := c.d.RunOnce(ctx); err != nil {
			c.t.Fatal(err)
		}
		j, err := c.st.JobGet(ctx, typ, key)
		if err != nil {
			c.t.Fatal(err)
		}
		if j.State == correlator.StateFinal || j.State == correlator.StateRunning || time.Now().After(deadline) {
			return j
		}
	}
}

func want(t *testing.T, j *correlator.Job, state correlator.State, outcome correlator.Outcome, attempt int) {
	t.Helper()
	if j.State != state || j.Outcome != outcome || j.Attempt != attempt {
		t.Fatalf("%s: state %s outcome %q attempt %d (error %q), want %s %q %d", j.JobKey, j.State, j.Outcome, j.Attempt, j.Error, state, outcome, attempt)
	}
}

// Async: 2xx means accepted; the request carries the job data, the
// configured and Hipq-* headers, and a callback URL signed for this attempt.
func TestHTTPAsyncSendsSignedCallback(t *testing.T) {
	t.Parallel()
	ds := newDownstream(t, func(string, int) (int, string) { return http.StatusAccepted, "" })
	c := newHTTPCase(t, ds.URL, 5*time.Second)
	c.insert("async", "a/1 x")
	j := c.settle("async", "a/1 x")
	want(t, j, correlator.StateRunning, "", 1) // waiting for its callback
	if n := scalar(t, c.st, "SELECT count(*) FROM hipq_attempt WHERE sent_at IS NOT NULL"); n != 1 {
		t.Fatalf("sent_at not recorded")
	}
	r := ds.calls[0]
	body, _ := io.ReadAll(r.Body)
	if r.Method != http.MethodPost || r.URL.EscapedPath() != "/calls/async/a%2F1%20x" || string(body) != `{"n": 1}` {
		t.Fatalf("call %s %s body %s", r.Method, r.URL.EscapedPath(), body)
	}
	if r.Header.Get("X-Api-Key") != "k1" || r.Header.Get("Hipq-Job-Type") != "async" || r.Header.Get("Hipq-Job-Key") != "a/1 x" ||
		r.Header.Get("Hipq-Attempt") != "1" || r.Header.Get("Hipq-Job-Id") != strconv.FormatInt(j.ID, 10) {
		t.Fatalf("headers %v", r.Header)
	}
	cb, err := url.Parse(r.Header.Get("Hipq-Callback-Url"))
	if err != nil || cb.Host != "hipq.example" || cb.EscapedPath() != "/v1/jobs/async/a%2F1%20x/response" {
		t.Fatalf("callback URL %q", r.Header.Get("Hipq-Callback-Url"))
	}
	q := cb.Query()
	if q.Get("job_id") != strconv.FormatInt(j.ID, 10) || q.Get("attempt") != "1" ||
		!correlator.CallbackSignatureValid(secret, j.ID, "async", "a/1 x", 1, q.Get("sig")) {
		t.Fatalf("callback query %v does not verify", q)
	}
}

// Sync: a 2xx body is the reply. Success finalizes with it as the result;
// 500, 500, 200 under a 3-attempt policy succeeds at attempt 3.
func TestHTTPSync(t *testing.T) {
	t.Parallel()
	ds := newDownstream(t, func(key string, n int) (int, string) {
		switch {
		case key == "flaky" && n < 3:
			return http.StatusInternalServerError, "try later"
		case key == "says-failed":
			return http.StatusOK, `{"status": "failed", "error": "no stock", "retryable": false}`
		case key == "plain":
			return http.StatusOK, "done"
		}
		return http.StatusOK, `{"status": "ok", "tracking": "T1"}`
	})
	c := newHTTPCase(t, ds.URL, 5*time.Second)
	for _, k := range []string{"ok", "flaky", "says-failed", "plain"} {
		c.insert("sync", k)
	}
	j := c.settle("sync", "ok")
	want(t, j, correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	if string(j.Result) != `{"status": "ok", "tracking": "T1"}` {
		t.Fatalf("result %s", j.Result)
	}
	j = c.settle("sync", "flaky")
	want(t, j, correlator.StateFinal, correlator.OutcomeSucceeded, 3)
	if ds.callCount("flaky") != 3 || ds.calls[0].Method != http.MethodPut {
		t.Fatalf("%d calls", ds.callCount("flaky"))
	}
	var errs []string
	rows, _ := c.st.Pool().Query(ctx, `SELECT a.outcome || ': ' || coalesce(a.error, '') FROM hipq_attempt a JOIN hipq_job j ON j.queue = a.queue AND j.id = a.job_id
		WHERE j.job_key = 'flaky' ORDER BY a.attempt`)
	for rows.Next() {
		var s string
		_ = rows.Scan(&s)
		errs = append(errs, s)
	}
	if len(errs) != 3 || !strings.HasPrefix(errs[0], "dispatch_error: PUT ") || !strings.Contains(errs[0], "HTTP 500 Internal Server Error: try later") || errs[2] != "succeeded: " {
		t.Fatalf("attempts %q", errs)
	}
	j = c.settle("sync", "says-failed")
	want(t, j, correlator.StateFinal, correlator.OutcomeFailed, 1)
	if j.Error != "no stock" {
		t.Fatalf("error %q", j.Error)
	}
	j = c.settle("sync", "plain")
	want(t, j, correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	if string(j.Result) != `"done"` {
		t.Fatalf("a body that is not JSON is stored as a JSON string, got %s", j.Result)
	}
	// Metrics: 4 sends delivered, flaky's two 500s failed, 4 sync replies
	// applied, each attempt's round trip observed.
	sent := testutil.ToFloat64(c.m.Dispatches.WithLabelValues("default", "http", "sent"))
	failed := testutil.ToFloat64(c.m.Dispatches.WithLabelValues("default", "http", "failed"))
	applied := testutil.ToFloat64(c.m.Replies.WithLabelValues("sync", "applied"))
	if sent != 4 || failed != 2 || applied != 4 || testutil.ToFloat64(c.m.Claimed.WithLabelValues("default")) != 6 {
		t.Fatalf("metrics: sent %v failed %v applied %v, want 4 2 4", sent, failed, applied)
	}
	if n, _ := c.m.Value("hipq_round_trip_seconds", nil); n != 4 {
		t.Fatalf("round trips observed: %v, want 4", n)
	}
}

// A 4xx other than 408/429 fails without retry; 408 and 429 are retried
// even for at_most_once types; a 5xx of an at_most_once type is final.
func TestHTTPStatusClasses(t *testing.T) {
	t.Parallel()
	ds := newDownstream(t, func(key string, n int) (int, string) {
		switch {
		case key == "bad":
			return http.StatusUnprocessableEntity, `{"error": "bad shipment"}`
		case key == "busy" && n == 1:
			return http.StatusTooManyRequests, ""
		case key == "slowpoke" && n == 1:
			return http.StatusRequestTimeout, ""
		case key == "broken":
			return http.StatusBadGateway, ""
		case key == "moved":
			return http.StatusFound, ""
		}
		return http.StatusOK, `{}`
	})
	c := newHTTPCase(t, ds.URL, 5*time.Second)
	c.insert("sync", "bad")
	c.insert("amo", "busy")
	c.insert("amo", "slowpoke")
	c.insert("amo", "broken")
	c.insert("sync", "moved")
	want(t, c.settle("sync", "bad"), correlator.StateFinal, correlator.OutcomeFailed, 1)
	want(t, c.settle("amo", "busy"), correlator.StateFinal, correlator.OutcomeSucceeded, 2)
	want(t, c.settle("amo", "slowpoke"), correlator.StateFinal, correlator.OutcomeSucceeded, 2)
	want(t, c.settle("amo", "broken"), correlator.StateFinal, correlator.OutcomeFailed, 1)
	want(t, c.settle("sync", "moved"), correlator.StateFinal, correlator.OutcomeFailed, 1)
	if j, _ := c.st.JobGet(ctx, "sync", "bad"); !strings.Contains(j.Error, "HTTP 422") || !strings.Contains(j.Error, "bad shipment") {
		t.Fatalf("error %q does not say what the downstream said", j.Error)
	}
}

// A timeout is a retryable dispatch error for at_least_once types and final
// for at_most_once ones (the request may have arrived); a refused
// connection surely did not arrive and is retried for both.
func TestHTTPTimeoutAndRefused(t *testing.T) {
	t.Parallel()
	ds := newDownstream(t, func(key string, n int) (int, string) {
		if n == 1 {
			return 0, "" // hang
		}
		return http.StatusOK, `{}`
	})
	c := newHTTPCase(t, ds.URL, 200*time.Millisecond)
	c.insert("sync", "hang-s")
	c.insert("amo", "hang-a")
	want(t, c.settle("sync", "hang-s"), correlator.StateFinal, correlator.OutcomeSucceeded, 2)
	j := c.settle("amo", "hang-a")
	want(t, j, correlator.StateFinal, correlator.OutcomeFailed, 1)
	if !strings.Contains(j.Error, "no answer within the timeout") {
		t.Fatalf("error %q", j.Error)
	}

	// A port nothing listens on.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + l.Addr().String()
	l.Close()
	c2 := newHTTPCase(t, dead, time.Second)
	c2.insert("sync", "refused")
	c2.insert("amo", "refused")
	for _, typ := range []string{"sync", "amo"} {
		j := c2.settle(typ, "refused")
		// A refused connection is an outage of the host: undone, not
		// counted, while it is young; once it outlasts the call timeout
		// each attempt is a dispatch error, retried to the end of the
		// policy, then failed.
		want(t, j, correlator.StateFinal, correlator.OutcomeFailed, 3)
		if !strings.Contains(j.Error, "connection refused") {
			t.Fatalf("%s: error %q", typ, j.Error)
		}
	}
	if n := scalar(t, c2.st, "SELECT count(*) FROM hipq_attempt WHERE outcome = 'dispatch_error'"); n != 6 {
		t.Fatalf("%d dispatch_error attempts, want 6", n)
	}
}

// A call that waited for a slot longer than StartWithin is not made: its
// claim is given back rather than sent while the sweeper may take it for
// dead. The wait is measured on this process's monotonic clock from before
// the claim, so a wall clock 60 s off either way, this host's against
// PostgreSQL's (which stamped started_at), changes nothing (issue 9.5).
func TestHTTPLateStartIsNotSent(t *testing.T) {
	t.Parallel()
	ds := newDownstream(t, func(string, int) (int, string) { return http.StatusOK, "" })
	s := dispatcher.NewHTTPSender(dispatcher.HTTPSenderConfig{StartWithin: 30 * time.Second,
		Routes: map[string]dispatcher.HTTPRoute{"async": {URL: ds.URL + "/x"}}})
	now := time.Now()
	rs := s.Send(ctx, []store.Claimed{
		{ID: 1, JobType: "async", JobKey: "late", Attempt: 1, StartedAt: now, ClaimedLocal: now.Add(-time.Minute)},
		{ID: 2, JobType: "async", JobKey: "fresh", Attempt: 1, StartedAt: now, ClaimedLocal: now},
		{ID: 3, JobType: "async", JobKey: "db-behind", Attempt: 1, StartedAt: now.Add(-time.Minute), ClaimedLocal: now},
		{ID: 4, JobType: "async", JobKey: "db-ahead", Attempt: 1, StartedAt: now.Add(time.Minute), ClaimedLocal: now},
		{ID: 5, JobType: "async", JobKey: "late-db-ahead", Attempt: 1, StartedAt: now.Add(time.Minute), ClaimedLocal: now.Add(-time.Minute)},
	})
	for i, want := range []dispatcher.SendStatus{dispatcher.NotSent, dispatcher.Sent, dispatcher.Sent, dispatcher.Sent, dispatcher.NotSent} {
		if rs[i].Status != want {
			t.Errorf("job %d: status %v (%v), want %v", i+1, rs[i].Status, rs[i].Err, want)
		}
	}
	if ds.callCount("late") != 0 || ds.callCount("late-db-ahead") != 0 {
		t.Fatalf("late calls were made")
	}
}

// newTLSCase is newHTTPCase with tc as the TLS of every route.
func newTLSCase(t *testing.T, target string, tc *tls.Config) *httpCase {
	t.Helper()
	retry := &correlator.Backoff{Attempts: 3, Initial: time.Millisecond,
		When: []correlator.AttemptOutcome{correlator.AttemptFailed, correlator.AttemptDispatchError}}
	types := map[string]*correlator.JobType{
		"sync": {Name: "sync", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: retry},
		"amo":  {Name: "amo", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtMostOnce, Retry: retry},
	}
	routes := map[string]dispatcher.HTTPRoute{
		"sync": {URL: target + "/calls/{job_key}", Timeout: 5 * time.Second, Sync: true, TLS: tc},
		"amo":  {URL: target + "/calls/{job_key}", Timeout: 5 * time.Second, Sync: true, Delivery: correlator.AtMostOnce, TLS: tc},
	}
	s := dispatcher.NewHTTPSender(dispatcher.HTTPSenderConfig{Routes: routes})
	st := pgtest.New(t)
	m := metrics.New()
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 50,
		Queues: []dispatcher.QueueConfig{{Name: "default"}}, Types: types, Senders: map[string]dispatcher.Sender{"sync": s, "amo": s}, Metrics: m})
	return &httpCase{t: t, st: st, d: d, m: m, types: types}
}

// A downstream over HTTPS with a certificate of a private CA that demands
// mutual TLS: a route with the CA and a client certificate (as
// transport.http.tls builds it) gets its reply. A route that does not
// trust the downstream's certificate, or that has no client certificate to
// show, never delivers its request: the claim is undone, as for a refused
// connection, no attempt spent (at_most_once types included).
func TestHTTPOverTLS(t *testing.T) {
	t.Parallel()
	ca, clientCA := certtest.NewCA(t, "downstream"), certtest.NewCA(t, "clients")
	hipqCert := clientCA.Client(t, "hipq")
	var calls atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if len(r.TLS.PeerCertificates) == 0 || r.TLS.PeerCertificates[0].Subject.CommonName != "hipq" {
			w.WriteHeader(http.StatusForbidden)
			return
		}
		_, _ = io.WriteString(w, `{"status": "succeeded", "who": "downstream"}`)
	}))
	srv.TLS = ca.ServerTLS(t, []string{"127.0.0.1"}, clientCA)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshakes refused below
	srv.StartTLS()
	defer srv.Close()

	good, err := tlsconf.Client(tlsconf.Files{CAFile: ca.File, CertFile: hipqCert.CertFile, KeyFile: hipqCert.KeyFile})
	if err != nil {
		t.Fatal(err)
	}
	c := newTLSCase(t, srv.URL, good)
	c.insert("sync", "ok")
	want(t, c.settle("sync", "ok"), correlator.StateFinal, correlator.OutcomeSucceeded, 1)

	noCert, err := tlsconf.Client(tlsconf.Files{CAFile: ca.File})
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]*tls.Config{"the system's roots": nil, "no client certificate": noCert} {
		c := newTLSCase(t, srv.URL, tc)
		before := calls.Load()
		for _, typ := range []string{"sync", "amo"} {
			c.insert(typ, "refused")
			if _, err := c.d.RunOnce(ctx); err != nil {
				t.Fatal(err)
			}
			j, err := c.st.JobGet(ctx, typ, "refused")
			if err != nil {
				t.Fatal(err)
			}
			want(t, j, correlator.StateInitial, "", 0)
		}
		if n := calls.Load() - before; n != 0 {
			t.Errorf("%s: the downstream served %d calls", name, n)
		}
		if n := scalar(t, c.st, "SELECT count(*) FROM hipq_attempt"); n != 0 {
			t.Errorf("%s: %d attempts left, want every claim undone", name, n)
		}
	}
}

// A TLS alert from the host: about the handshake (hipq's certificate
// refused), or any alert before the request went out, is refused, never
// an attempt; another alert once the request went out (a proxy that read
// it, then broke off) may have delivered it, so an at_most_once job ends.
func TestClassifyTLSAlerts(t *testing.T) {
	alert := func(text string) error {
		return &url.Error{Op: "Post", URL: "https://h/x", Err: fmt.Errorf("net/http: HTTP/1.x transport connection broken: %w",
			&net.OpError{Op: "remote error", Err: errors.New(text)})}
	}
	for _, c := range []struct {
		text  string
		wrote bool
		want  dispatcher.SendStatus
		final bool
	}{
		{"tls: certificate required", true, dispatcher.Refused, false},
		{"tls: bad certificate", true, dispatcher.Refused, false},
		{"tls: unknown certificate authority", false, dispatcher.Refused, false},
		{"tls: internal error", false, dispatcher.Refused, false},
		{"tls: internal error", true, dispatcher.Failed, true},
		{"tls: close notify", true, dispatcher.Failed, true},
	} {
		r := dispatcher.ClassifyCallError("POST", "https://h/x", "https://h/x", alert(c.text), correlator.AtMostOnce, c.wrote)
		if r.Status != c.want || r.Final != c.final {
			t.Errorf("%q (written %v): %v final %v, want %v final %v", c.text, c.wrote, r.Status, r.Final, c.want, c.final)
		}
	}
}

package api

import (
	"net/http"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/hipq/hipq/store"
)

// An applied callback is a span "process callback", a child of its
// attempt's send span (kept on the attempt) linked to the call's own
// traceparent, saying how the attempt ended; a job enqueued with a
// traceparent keeps it.
func TestCallbackSpan(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(ctx) //nolint:errcheck // a span recorder has nothing to flush
	e := newAPIConfig(t, func(c *Config) { c.Tracer = tp.Tracer("test") })
	const (
		sendTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
		sendSpan  = "00f067aa0ba902b7"
		ownTrace  = "0af7651916cd43dd8448eb211c80319c"
	)
	e.enqueueTraced("traced", "00-"+ownTrace+"-b7ad6b7169203331-01")
	if j, _ := e.st.JobGet(ctx, "t", "traced"); j.Trace.Parent != "00-"+ownTrace+"-b7ad6b7169203331-01" {
		t.Fatalf("the job kept trace %+v", j.Trace)
	}
	cl, err := e.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 10, Instance: "i"})
	if err != nil || len(cl.Jobs) != 1 {
		t.Fatalf("claim: %v %v", cl, err)
	}
	c := cl.Jobs[0].ID
	if _, err := e.st.Pool().Exec(ctx, `UPDATE hipq_attempt SET trace_parent = $1 WHERE job_id = $2`,
		"00-"+sendTrace+"-"+sendSpan+"-01", c); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(http.MethodPost, e.url+signed(c, "traced", 1), strings.NewReader(`{"status": "succeeded"}`))
	req.Header.Set("traceparent", "00-"+ownTrace+"-c7ad6b7169203331-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("callback: %v %v", resp, err)
	}
	resp.Body.Close()
	spans := rec.Ended()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want 1", len(spans))
	}
	s := spans[0]
	if s.Name() != "process callback" || s.SpanContext().TraceID().String() != sendTrace || s.Parent().SpanID().String() != sendSpan {
		t.Fatalf("span %q in trace %s, parent %s", s.Name(), s.SpanContext().TraceID(), s.Parent().SpanID())
	}
	if l := s.Links(); len(l) != 1 || l[0].SpanContext.TraceID().String() != ownTrace {
		t.Errorf("links %v, want the call's own trace", l)
	}
	found := false
	for _, a := range s.Attributes() {
		found = found || (string(a.Key) == "hipq.outcome" && a.Value.AsString() == "succeeded")
	}
	if !found {
		t.Errorf("attributes %v, want hipq.outcome succeeded", s.Attributes())
	}
}

// With a tracer provider, every API request is a server span, a child of
// the caller's traceparent, and the job an enqueue makes keeps the server
// span's context: its sends join the caller's trace under the API call.
func TestAPIServerSpans(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(ctx) //nolint:errcheck // a span recorder has nothing to flush
	e := newAPIConfig(t, func(c *Config) { c.Tracer, c.TracerProvider = tp.Tracer("test"), tp })
	const caller = "0af7651916cd43dd8448eb211c80319c"
	e.enqueueTraced("served", "00-"+caller+"-b7ad6b7169203331-01")
	spans := rec.Ended()
	if len(spans) != 1 || spans[0].Name() != "PUT /v1/jobs/{job_type}/{job_key}" || spans[0].Parent().SpanID().String() != "b7ad6b7169203331" {
		t.Fatalf("spans %v", spans)
	}
	server := spans[0].SpanContext()
	j, _ := e.st.JobGet(ctx, "t", "served")
	if want := "00-" + caller + "-" + server.SpanID().String() + "-01"; j.Trace.Parent != want {
		t.Fatalf("the job kept %q, want the server span's %q", j.Trace.Parent, want)
	}
}

// enqueueTraced enqueues job t/key with a traceparent header.
func (e *apiEnv) enqueueTraced(key, traceparent string) {
	e.t.Helper()
	req, _ := http.NewRequest(http.MethodPut, e.url+"/v1/jobs/t/"+key, strings.NewReader(`{}`))
	req.Header.Set("traceparent", traceparent)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusCreated {
		e.t.Fatalf("enqueue: %v %v", resp, err)
	}
	resp.Body.Close()
}

// A callback's retry_after (seconds, as a number or text, or a time) is
// read into the reply; one that is neither is refused naming the field.
func TestCallbackRetryAfter(t *testing.T) {
	id := int64(1)
	for body, want := range map[string]time.Duration{
		`{"status": "failed", "retry_after": 5}`:    5 * time.Second,
		`{"status": "failed", "retry_after": "2"}`:  2 * time.Second,
		`{"status": "failed", "retry_after": null}`: 0,
	} {
		r, err := decodeCallback([]byte(body), "t", "k", &id, nil, 4096)
		if err != nil || r.RetryAfter.Delay != want {
			t.Errorf("%s: %+v %v, want %v", body, r, err, want)
		}
	}
	r, err := decodeCallback([]byte(`{"status": "failed", "retry_after": "2026-11-25T08:00:00Z"}`), "t", "k", &id, nil, 4096)
	if err != nil || r.RetryAfter.At.IsZero() {
		t.Errorf("a time: %+v %v", r, err)
	}
	if _, err := decodeCallback([]byte(`{"status": "failed", "retry_after": "later"}`), "t", "k", &id, nil, 4096); err == nil ||
		!strings.Contains(err.Error(), "retry_after") {
		t.Errorf("an unreadable retry_after: %v", err)
	}
}

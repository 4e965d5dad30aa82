package dispatcher_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// Traced HTTP sends: the send span is a child of the job's intake
// context, the HTTP client span a child of the send span, and the call
// carries the client span's traceparent; a sync reply is a span under the
// send span too. The send span's context is kept on the attempt.
func TestHTTPSendSpans(t *testing.T) {
	t.Parallel()
	const intake = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ds, st, rec := tracedSend(t, intake, true)
	byName := map[string]sdktrace.ReadOnlySpan{}
	for _, sp := range rec.Ended() {
		byName[sp.Name()] = sp
	}
	send, reply := byName["send "+ds.URL], byName["process sync reply"]
	var client sdktrace.ReadOnlySpan
	for name, sp := range byName {
		if strings.HasPrefix(name, "HTTP ") || name == "POST" {
			client = sp
		}
	}
	if send == nil || reply == nil || client == nil {
		t.Fatalf("spans %v, want send, client and reply spans", byName)
	}
	if send.SpanContext().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || send.Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Errorf("send span in %s under %s, want the intake's", send.SpanContext().TraceID(), send.Parent().SpanID())
	}
	if client.Parent().SpanID() != send.SpanContext().SpanID() || reply.Parent().SpanID() != send.SpanContext().SpanID() {
		t.Errorf("client span under %s, reply span under %s, want the send span %s", client.Parent().SpanID(), reply.Parent().SpanID(), send.SpanContext().SpanID())
	}
	ds.mu.Lock()
	got := ds.calls[0].Header.Get("traceparent")
	ds.mu.Unlock()
	if want := "00-4bf92f3577b34da6a3ce929d0e0e4736-" + client.SpanContext().SpanID().String() + "-01"; got != want {
		t.Errorf("the call carried %q, want the client span's %q", got, want)
	}
	var kept string
	if err := st.Pool().QueryRow(ctx, `SELECT trace_parent FROM hipq_attempt`).Scan(&kept); err != nil ||
		!strings.Contains(kept, send.SpanContext().SpanID().String()) {
		t.Errorf("attempt keeps %q (%v), want the send span", kept, err)
	}
}

// Parent-based sampling holds however long after intake a job is sent: a
// job that came in an unsampled trace records no span, and its request
// still carries the trace, unsampled.
func TestUnsampledIntakeStaysUnsampled(t *testing.T) {
	t.Parallel()
	const intake = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
	ds, _, rec := tracedSend(t, intake, false)
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("%d spans recorded for an unsampled trace", n)
	}
	ds.mu.Lock()
	got := ds.calls[0].Header.Get("traceparent")
	ds.mu.Unlock()
	if !strings.HasPrefix(got, "00-4bf92f3577b34da6a3ce929d0e0e4736-") || !strings.HasSuffix(got, "-00") {
		t.Fatalf("the call carried %q, want the intake's trace, unsampled", got)
	}
}

// tracedSend sends one job that came in trace context intake over HTTP
// (sync or async) with tracing on, and returns the downstream, the store
// and the spans recorded.
func tracedSend(t *testing.T, intake string, sync bool) (*downstream, *store.Store, *tracetest.SpanRecorder) {
	t.Helper()
	ds := newDownstream(t, func(string, int) (int, string) { return http.StatusOK, `{"status": "ok"}` })
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(ctx) })
	st := pgtest.New(t)
	types := map[string]*correlator.JobType{"web": {Name: "web", Queue: "default", Timeout: time.Hour, Retry: correlator.NoRetry}}
	s := dispatcher.NewHTTPSender(dispatcher.HTTPSenderConfig{TracerProvider: tp,
		Routes: map[string]dispatcher.HTTPRoute{"web": {URL: ds.URL + "/{job_key}", Sync: sync, Timeout: 5 * time.Second}}})
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", Queues: []dispatcher.QueueConfig{{Name: "default"}},
		Types: types, Senders: map[string]dispatcher.Sender{"web": s}, Tracer: tp.Tracer("test")})
	j := &correlator.Job{Queue: "default", JobType: "web", JobKey: "k", JobData: json.RawMessage(`{}`), MaxAttempts: 1,
		Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second),
		Trace: correlator.TraceContext{Parent: intake}}
	if _, err := st.JobsInsert(ctx, []*correlator.Job{j}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	return ds, st, rec
}

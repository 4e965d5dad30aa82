package main

import (
	"compress/gzip"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"google.golang.org/protobuf/proto"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
)

// span is what the test collector keeps of one exported span.
type span struct {
	name, traceID, spanID, parentID string
	links                           []string // trace ids
	attrs                           map[string]string
}

// collector is an in-process OTLP/HTTP trace receiver.
type collector struct {
	mu    sync.Mutex
	spans []span
}

func (c *collector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body io.Reader = r.Body
	if r.Header.Get("Content-Encoding") == "gzip" {
		gz, err := gzip.NewReader(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body = gz
	}
	b, err := io.ReadAll(body)
	var req collectortrace.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(b, &req)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	c.mu.Lock()
	for _, rs := range req.ResourceSpans {
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				sp := span{name: s.Name, traceID: hex.EncodeToString(s.TraceId), spanID: hex.EncodeToString(s.SpanId),
					parentID: hex.EncodeToString(s.ParentSpanId), attrs: map[string]string{}}
				for _, l := range s.Links {
					sp.links = append(sp.links, hex.EncodeToString(l.TraceId))
				}
				for _, a := range s.Attributes {
					v := a.Value.GetStringValue()
					if v == "" {
						v = fmt.Sprint(a.Value.GetIntValue())
					}
					sp.attrs[a.Key] = v
				}
				c.spans = append(c.spans, sp)
			}
		}
	}
	c.mu.Unlock()
	out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (c *collector) find(match func(span) bool) []span {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []span
	for _, s := range c.spans {
		if match(s) {
			out = append(out, s)
		}
	}
	return out
}

// Issue 15.1: a job request carrying trace T yields requests whose
// traceparent is in T with a new span id, a send span per attempt in T
// (attempt 2, after a failed reply, too), and a reply span in T, a child
// of its attempt's send span linked to the reply's own trace — with hipq
// restarted between intake and dispatch.
func TestTraceAcrossTheLoop(t *testing.T) {
	t.Parallel()
	col := &collector{}
	srv := httptest.NewServer(col)
	defer srv.Close()
	e := newEnv(t, e2eTopics...)
	text := e2eConfig + fmt.Sprintf("tracing: {endpoint: %q, batch_timeout: 100ms}\n", srv.URL)
	const (
		intakeTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
		intakeSpan  = "00f067aa0ba902b7"
		replyTrace  = "0af7651916cd43dd8448eb211c80319c"
	)

	// Intake only, then stopped: the trace context waits in PostgreSQL.
	ctx := context.Background()
	first, err := newApp(ctx, e.config(text), zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), appOptions{roles: []string{"intake"}, metadataMinAge: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- first.run(runCtx) }()
	var recs []*kgo.Record
	for _, key := range []string{"traced-ok", "traced-retry", "traced-silent"} {
		recs = append(recs, &kgo.Record{Topic: e.kafka.Topic("jobs"), Value: []byte(jobReq(key)),
			Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte("00-" + intakeTrace + "-" + intakeSpan + "-01")}}})
	}
	recs = append(recs, &kgo.Record{Topic: e.kafka.Topic("jobs"), Value: []byte(jobReq("bad-traceparent")),
		Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte("00-not-a-trace")}}})
	const deadTrace = "11f92f3577b34da6a3ce929d0e0e4799"
	recs = append(recs, &kgo.Record{Topic: e.kafka.Topic("jobs"), Value: []byte(`{"job_type":"nope","job_key":"x"}`),
		Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte("00-" + deadTrace + "-00f067aa0ba902b7-01")}}})
	e.kafka.Produce(recs...)
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(first, "job_key IN ('traced-ok', 'traced-retry', 'traced-silent', 'bad-traceparent')")
		return n == 4, fmt.Sprint(n)
	}, "the jobs")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.scalar(first, `SELECT count(*) FROM hipq_dead_letter`)
		return n == 1, fmt.Sprint(n)
	}, "the dead letter")
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	first.close() // flushes its spans
	if dl := col.find(func(s span) bool { return s.name == "dead letter" && s.traceID == deadTrace }); len(dl) != 1 ||
		!strings.HasPrefix(dl[0].attrs["hipq.dead_letter.reason"], "unknown_job_type") {
		t.Fatalf("dead letter spans %v, want one in the record's trace naming the reason", dl)
	}

	// A responder that fails traced-retry's first attempt, and replies in
	// a trace of its own.
	requestParents := map[string][]string{}
	var mu sync.Mutex
	cl := e.kafka.Client(kgo.ConsumeTopics(e.kafka.Topic("requests")), kgo.ConsumerGroup("trace-responder"))
	rctx, rstop := context.WithCancel(ctx)
	defer rstop()
	go func() {
		defer cl.Close()
		for rctx.Err() == nil {
			cl.PollFetches(rctx).EachRecord(func(rec *kgo.Record) {
				var hs []kgo.RecordHeader
				var attempt, parent string
				for _, h := range rec.Headers {
					switch {
					case strings.HasPrefix(h.Key, "hipq-"):
						hs = append(hs, h)
						if h.Key == correlator.HeaderAttempt {
							attempt = string(h.Value)
						}
					case h.Key == "traceparent":
						parent = string(h.Value)
					}
				}
				mu.Lock()
				requestParents[string(rec.Key)] = append(requestParents[string(rec.Key)], parent)
				mu.Unlock()
				if string(rec.Key) == "traced-silent" {
					return // its attempts time out
				}
				status := "succeeded"
				if string(rec.Key) == "traced-retry" && attempt == "1" {
					status = "failed"
				}
				hs = append(hs, kgo.RecordHeader{Key: "traceparent", Value: []byte("00-" + replyTrace + "-b7ad6b7169203331-01")})
				cl.Produce(rctx, &kgo.Record{Topic: e.kafka.Topic("replies"), Key: rec.Key,
					Value: []byte(`{"status":"` + status + `"}`), Headers: hs}, nil)
			})
		}
	}()
	second := e.start(e.config(text), "dispatcher", "responses", "sweeper")
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		n := e.countJobs(second, "outcome = 'succeeded'")
		return n == 3, fmt.Sprint(n)
	}, "the jobs to succeed")

	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := len(col.find(func(s span) bool { return s.name == "timeout" && s.traceID == intakeTrace }))
		return n >= 1, fmt.Sprint(n)
	}, "a timeout of traced-silent")
	mu.Lock()
	parents := map[string][]string{}
	for k, v := range requestParents {
		parents[k] = append([]string(nil), v...)
	}
	mu.Unlock()
	for _, key := range []string{"traced-ok", "traced-retry"} {
		want := 1
		if key == "traced-retry" {
			want = 2
		}
		if len(parents[key]) != want {
			t.Fatalf("%s: %d requests, want %d", key, len(parents[key]), want)
		}
		for i, p := range parents[key] {
			if !strings.HasPrefix(p, "00-"+intakeTrace+"-") || strings.Contains(p, intakeSpan) {
				t.Errorf("%s attempt %d: request traceparent %q, want trace %s with a new span id", key, i+1, p, intakeTrace)
			}
		}
	}
	if p := parents["bad-traceparent"]; len(p) != 1 || strings.Contains(p[0], intakeTrace) || p[0] == "" {
		t.Errorf("a job with an invalid traceparent: request traceparents %v, want one trace of its own", p)
	}

	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		sends := col.find(func(s span) bool {
			return strings.HasPrefix(s.name, "send ") && s.traceID == intakeTrace && s.parentID == intakeSpan
		})
		procs := col.find(func(s span) bool { return strings.HasPrefix(s.name, "process ") && s.traceID == intakeTrace })
		timeouts := col.find(func(s span) bool { return s.name == "timeout" && s.traceID == intakeTrace })
		return len(sends) >= 4 && len(procs) == 3 && len(timeouts) >= 1,
			fmt.Sprintf("%d send spans, %d process spans, %d timeouts in the trace", len(sends), len(procs), len(timeouts))
	}, "the spans")
	sendIDs := map[string]span{}
	for _, s := range col.find(func(s span) bool { return strings.HasPrefix(s.name, "send ") && s.traceID == intakeTrace }) {
		sendIDs[s.spanID] = s
		if s.attrs["messaging.system"] != "kafka" || s.attrs["messaging.destination.name"] != e.kafka.Topic("requests") ||
			s.attrs["hipq.job.key"] == "" || s.attrs["hipq.attempt"] == "" {
			t.Errorf("send span attributes: %v", s.attrs)
		}
	}
	for _, key := range []string{"traced-ok", "traced-retry"} {
		for _, p := range parents[key] {
			if id := strings.Split(p, "-")[2]; sendIDs[id].name == "" {
				t.Errorf("%s: the request's span %s is not an exported send span", key, id)
			}
		}
	}
	for _, s := range col.find(func(s span) bool { return s.name == "timeout" && s.traceID == intakeTrace }) {
		if sendIDs[s.parentID].attrs["hipq.job.key"] != "traced-silent" || s.attrs["hipq.attempt.outcome"] != "timed_out" {
			t.Errorf("timeout span %s: parent %s, attributes %v, want a child of traced-silent's send span", s.spanID, s.parentID, s.attrs)
		}
	}
	for _, s := range col.find(func(s span) bool { return strings.HasPrefix(s.name, "process ") && s.traceID == intakeTrace }) {
		if sendIDs[s.parentID].name == "" {
			t.Errorf("reply span %s: parent %s is not a send span", s.spanID, s.parentID)
		}
		if len(s.links) != 1 || s.links[0] != replyTrace {
			t.Errorf("reply span %s: links %v, want the reply's own trace", s.spanID, s.links)
		}
		if s.attrs["messaging.operation.type"] != "process" || s.attrs["messaging.consumer.group.name"] == "" || s.attrs["hipq.outcome"] == "" {
			t.Errorf("reply span attributes: %v", s.attrs)
		}
	}
}

// A trace context never decides a job's fate: a future-version
// traceparent whose bytes after the 55th are a NUL or invalid UTF-8
// (which PostgreSQL refuses in text) is kept as its first 55 bytes, as a
// W3C level-1 reader parses it; a tracestate that is not printable ASCII
// is dropped. Every such job is stored, through Kafka intake, through
// the API's enqueue, and through the replay of a dead letter carrying
// such headers.
func TestUnstorableTraceContextIsDropped(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	const valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	const future = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" // the first 55 bytes of each below
	e := newEnv(t, e2eTopics...)
	text, url := withAPI(t, e2eConfig, "")
	a := e.start(e.config(text), "intake", "api")
	ctx := context.Background()
	// The record of job_key "replayed" is refused by a trigger, so that it
	// is a dead letter whatever its headers; the trigger goes before the
	// replay.
	if _, err := a.st.Pool().Exec(ctx, `
		CREATE FUNCTION refuse_replayed() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF NEW.job_key = 'replayed' THEN RAISE EXCEPTION 'not yet' USING ERRCODE = '54000'; END IF;
		  RETURN NEW;
		END $$;
		CREATE TRIGGER refuse_replayed BEFORE INSERT ON hipq_job FOR EACH ROW EXECUTE FUNCTION refuse_replayed();`); err != nil {
		t.Fatal(err)
	}
	want := map[string][2]string{} // job_key: trace_parent, trace_state
	rec := func(key, parent, state string, wantParent, wantState string) *kgo.Record {
		h := []kgo.RecordHeader{{Key: correlator.HeaderTraceParent, Value: []byte(parent)}}
		if state != "" {
			h = append(h, kgo.RecordHeader{Key: correlator.HeaderTraceState, Value: []byte(state)})
		}
		want[key] = [2]string{wantParent, wantState}
		return &kgo.Record{Topic: e.kafka.Topic("jobs"), Value: []byte(jobReq(key)), Headers: h}
	}
	e.kafka.Produce(
		rec("parent-nul", future+"-\x00x", "k=v", future, "k=v"),
		rec("parent-ff", future+"-\xff\xfe", "", future, ""),
		rec("parent-c3", future+"-a\xc3(", "", future, ""),
		rec("state-nul", valid, "k=\x00", valid, ""),
		rec("state-ff", valid, "k=\xff", valid, ""),
		rec("replayed", future+"-\x00", "k=\xff", future, ""),
	)
	waitAPI(t, url)
	put := func(key, parent, state, wantParent, wantState string) {
		t.Helper()
		r, _ := http.NewRequest(http.MethodPut, url+"/v1/jobs/e2e/"+key, strings.NewReader(`{"job_data": {}}`))
		r.Header.Set(correlator.HeaderTraceParent, parent)
		if state != "" {
			r.Header.Set(correlator.HeaderTraceState, state)
		}
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if b, _ := io.ReadAll(resp.Body); resp.StatusCode != http.StatusCreated {
			t.Fatalf("enqueue %s: %d %s, want 201", key, resp.StatusCode, b)
		}
		want[key] = [2]string{wantParent, wantState}
	}
	// HTTP itself refuses a NUL in a header; invalid UTF-8 passes it.
	put("api-parent-ff", future+"-\xff", "", future, "")
	put("api-state-ff", valid, "k=\xff", valid, "")

	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.scalar(a, `SELECT count(*) FROM hipq_dead_letter WHERE reason LIKE 'rejected:%not yet%'`)
		return n == 1, fmt.Sprintf("%d of 1", n)
	}, "the dead letter of the refused record")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(a, "job_key <> 'replayed'")
		return n == len(want)-1, fmt.Sprintf("%d of %d", n, len(want)-1)
	}, "the other jobs")
	if n := e.scalar(a, `SELECT count(*) FROM hipq_dead_letter`); n != 1 {
		t.Fatalf("%d dead letters, want only the refused record's", n)
	}
	if _, err := a.st.Pool().Exec(ctx, `DROP TRIGGER refuse_replayed ON hipq_job`); err != nil {
		t.Fatal(err)
	}
	var id int64
	if err := a.st.Pool().QueryRow(ctx, `SELECT id FROM hipq_dead_letter`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post(fmt.Sprintf("%s/v1/dead-letters/%d/replay", url, id), "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("replay: %d %s, want 202", resp.StatusCode, b)
	}

	rows, err := a.st.Pool().Query(ctx, `SELECT job_key, coalesce(trace_parent, ''), coalesce(trace_state, '') FROM hipq_job`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][2]string{}
	for rows.Next() {
		var key, parent, state string
		if err := rows.Scan(&key, &parent, &state); err != nil {
			t.Fatal(err)
		}
		got[key] = [2]string{parent, state}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for key, w := range want {
		if g, ok := got[key]; !ok || g != w {
			t.Errorf("job %s: stored %v with trace %q, want trace %q", key, ok, g, w)
		}
	}
}

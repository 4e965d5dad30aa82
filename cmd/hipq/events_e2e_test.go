package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
)

// eventsConfig is e2eConfig with outcome events on topic events (each
// retry too) and reply_to topics callers.* allowed.
func eventsConfig() string {
	return strings.Replace(e2eConfig, "job_types:", `events: {topic: "{{T:events}}", on: [final, attempt], allowed_reply_to: ["{{T:callers}}*"]}
job_types:`, 1)
}

var eventsTopics = append(append([]string(nil), e2eTopics...), "events", "callers.a")

// readEvents reads topic from its start until n records came.
func (e *env) readEvents(topic string, n int) []*kgo.Record {
	e.t.Helper()
	cl := e.kafka.Client(kgo.ConsumeTopics(e.kafka.Topic(topic)), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer cl.Close()
	var out []*kgo.Record
	deadline := time.Now().Add(time.Minute)
	for len(out) < n {
		if time.Now().After(deadline) {
			e.t.Fatalf("read %d of %d events from %s in a minute", len(out), n, topic)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) { out = append(out, r) })
		cancel()
	}
	return out
}

func recHeader(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// The round trip with events: a job that fails once then succeeds gives
// a retry event then its final one on the events topic; a job whose
// intake record named a reply_to gets its final event there too, with
// the hipq-correlation-id it came with; a job cancelled through the API
// (its own store) gets its cancelled event.
func TestEventsRoundTrip(t *testing.T) {
	t.Parallel()
	e := newEnv(t, eventsTopics...)
	text, apiURL := withAPI(t, eventsConfig(), "")
	e.start(e.config(text))
	waitAPI(t, apiURL)
	for _, call := range []struct{ method, path, body string }{
		{"PUT", "/v1/jobs/e2e/later", `{"scheduled_run_time": "2099-01-01T00:00:00Z"}`},
		{"POST", "/v1/jobs/e2e/later/cancel", ""},
	} {
		req, _ := http.NewRequest(call.method, apiURL+call.path, strings.NewReader(call.body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode >= 300 {
			t.Fatalf("%s %s: %s", call.method, call.path, resp.Status)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.respond(ctx, "requests", "replies", func(key string, attempt int) (string, bool) {
		return map[bool]string{true: "succeeded", false: "failed"}[attempt > 1 || key == "asker"], true
	})
	e.kafka.Produce(
		&kgo.Record{Topic: e.kafka.Topic("jobs"), Value: []byte(jobReq("twice"))},
		&kgo.Record{Topic: e.kafka.Topic("jobs"), Value: []byte(jobReq("asker")), Headers: []kgo.RecordHeader{
			{Key: correlator.HeaderReplyTo, Value: []byte(e.kafka.Topic("callers.a"))},
			{Key: correlator.HeaderCorrelationID, Value: []byte("c-7")}}},
	)
	evs := e.readEvents("events", 4)
	var got []string
	for _, r := range evs {
		got = append(got, string(r.Key)+":"+recHeader(r, correlator.HeaderOutcome))
	}
	for _, want := range []string{"asker:succeeded", "later:cancelled"} {
		if !strings.Contains(strings.Join(got, ","), want) {
			t.Errorf("events %v, want %s", got, want)
		}
	}
	if i, j := strings.Index(strings.Join(got, ","), "twice:retry"), strings.Index(strings.Join(got, ","), "twice:succeeded"); i < 0 || j < i {
		t.Errorf("events %v, want twice's retry then its success", got)
	}
	reply := e.readEvents("callers.a", 1)[0]
	var v map[string]any
	if err := json.Unmarshal(reply.Value, &v); err != nil {
		t.Fatal(err)
	}
	if string(reply.Key) != "asker" || recHeader(reply, correlator.HeaderCorrelationID) != "c-7" || v["outcome"] != "succeeded" ||
		v["state"] != "final" || fmt.Sprint(v["result"]) == "<nil>" {
		t.Errorf("reply_to event %s %v: %s", reply.Key, reply.Headers, reply.Value)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return e.adminScalar(pgtest.PendingEventsSQL("")) == 0 }, "every event deleted")
}

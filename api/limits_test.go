package api

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/kafkatest"
)

// Issue 9.1 through the API: a job_key over its limit is a 400 naming the
// field and the limit, never a 500 (nor a log line holding the key).
func TestNamesOverTheirLimits(t *testing.T) {
	t.Parallel()
	e := newAPI(t)
	long := strings.Repeat("k", 20<<10)
	for _, path := range []string{"/v1/jobs/t/" + long, "/v1/jobs/t/" + long + "/cancel"} {
		method := "PUT"
		if strings.HasSuffix(path, "/cancel") {
			method = "POST"
		}
		got, out := e.call(method, path, `{}`)
		msg, _ := out["error"].(map[string]any)["message"].(string)
		if got != 400 || errCode(out) != "too_large" || !strings.Contains(msg, "job_key: 20480 bytes is more than the limit of 1024") {
			t.Fatalf("%s with a 20 KB key: %d %v", method, got, out)
		}
	}
	out := e.want("PUT", "/v1/jobs/"+strings.Repeat("t", 300)+"/k", `{}`, 400)
	if msg, _ := out["error"].(map[string]any)["message"].(string); !strings.Contains(msg, "job_type: 300 bytes is more than the limit of 255") {
		t.Fatalf("%v", out)
	}
}

// From trying the API by hand: a caller without a valid token learns
// nothing of what is wrong with its input (401 before 400 or 404).
func TestTokenCheckedBeforeInput(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	e.token = ""
	for _, c := range []struct{ method, path, body string }{
		{"PUT", "/v1/jobs/t/" + strings.Repeat("k", 2000), `{}`},
		{"PUT", "/v1/jobs/nope/k", `{}`},
		{"PUT", "/v1/jobs/t/k", `{"priority": "high"}`},
		{"GET", "/v1/jobs?limit=-1", ""},
		{"GET", "/v1/jobs?cursor=x", ""},
		{"POST", "/v1/queues/undeclared/pause", ""},
		{"POST", "/v1/dead-letters/x/replay", ""},
		{"POST", "/v1/jobs/t/k/response?job_id=x&attempt=1", `{"status": "succeeded"}`},
		{"POST", "/v1/jobs/t/k/response?job_id=1&attempt=zero&sig=abc", `{"status": "succeeded"}`},
	} {
		if got, out := e.call(c.method, c.path, c.body); got != 401 {
			t.Errorf("%s %s without a token: %d %v, want 401", c.method, c.path, got, out)
		}
	}
}

// Issue 9.8: a refused callback reaches responses.dead_letter_topic too,
// with its reason in hipq-error.
func TestRefusedCallbackCopiedToTheDeadLetterTopic(t *testing.T) {
	t.Parallel()
	k := kafkatest.New(t)
	topic := k.Topic("replies.dlq")
	k.CreateTopics(1, topic)
	cl := k.Client()
	defer cl.Close()
	e := newAPIWith(t, &deadletter.Copier{Client: cl, Topic: topic}, token)
	id := e.running("k")
	e.token = ""
	e.want("POST", signed(id, "k", 7), `{"status": "succeeded"}`, 422)
	rd := k.Client(kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer rd.Close()
	pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for pctx.Err() == nil {
		var reason string
		rd.PollFetches(pctx).EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == correlator.HeaderError {
					reason = string(h.Value)
				}
			}
		})
		if reason != "" {
			if !strings.HasPrefix(reason, "newer_attempt") {
				t.Fatalf("copy's reason %q", reason)
			}
			return
		}
	}
	t.Fatal("no copy of the refused callback on the dead-letter topic")
}

package api

import (
	"testing"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

// The enqueue body's reply_to is kept with the job when
// events.allowed_reply_to allows it; one it does not allow is refused 400
// reply_to_not_allowed, and no job is made.
func TestEnqueueReplyTo(t *testing.T) {
	t.Parallel()
	e := newAPIConfig(t, func(c *Config) { c.Types["t"].AllowedReplyTo = []string{"callers.*"} })
	e.want("PUT", "/v1/jobs/t/ok", `{"reply_to": "callers.billing", "job_data": {"a": 1}}`, 201)
	j, err := e.st.JobGet(ctx, "t", "ok")
	if err != nil || j.ReplyTo != "callers.billing" {
		t.Fatalf("stored %+v (%v), want reply_to callers.billing", j, err)
	}
	if out := e.want("PUT", "/v1/jobs/t/bad", `{"reply_to": "payments.requests"}`, 400); errCode(out) != correlator.CodeReplyToNotAllowed {
		t.Errorf("a reply_to not allowed: %v", out)
	}
	if out := e.want("PUT", "/v1/jobs/t/num", `{"reply_to": 7}`, 400); errCode(out) != correlator.CodeInvalidField {
		t.Errorf("a reply_to not a string: %v", out)
	}
	for _, key := range []string{"bad", "num"} {
		if _, err := e.st.JobGet(ctx, "t", key); err != correlator.ErrNotFound {
			t.Errorf("job %s: %v, want none", key, err)
		}
	}
}

// A bulk replay of intake dead letters reads their records' headers as the
// intake does: reply_to and the correlation headers kept with the job, a
// reply_to not allowed skipped (no job), as a single replay would.
func TestBulkDeadLetterReplayKeepsReplyTo(t *testing.T) {
	t.Parallel()
	e := newAPIConfig(t, func(c *Config) { c.Types["t"].AllowedReplyTo = []string{"callers.*"} })
	hs := func(replyTo string) []correlator.Header {
		return []correlator.Header{{Key: correlator.HeaderReplyTo, Value: []byte(replyTo)},
			{Key: "hipq-correlation-id", Value: []byte("c-" + replyTo)}}
	}
	if err := e.st.DeadLetterInsert(ctx, []store.DeadLetter{
		{Kind: store.SourceIntake, Reason: "unknown_job_type: t",
			Source: store.Source{Value: []byte(`{"job_type": "t", "job_key": "ok"}`), Headers: hs("callers.a")}},
		{Kind: store.SourceIntake, Reason: "reply_to_not_allowed",
			Source: store.Source{Value: []byte(`{"job_type": "t", "job_key": "bad"}`), Headers: hs("payments.requests")}},
	}); err != nil {
		t.Fatal(err)
	}
	e.want("POST", "/v1/dead-letters/replay", `{"filter": {"source": "intake"}, "reason": "t is configured now"}`, 200)
	j, err := e.st.JobGet(ctx, "t", "ok")
	if err != nil || j.ReplyTo != "callers.a" {
		t.Fatalf("ok: %+v (%v), want its reply_to", j, err)
	}
	var kept int
	if err := e.st.Pool().QueryRow(ctx, `SELECT count(*) FROM hipq_job WHERE job_key = 'ok' AND correlation::text LIKE '%hipq-correlation-id%'`).Scan(&kept); err != nil || kept != 1 {
		t.Fatalf("ok: correlation headers kept %d (%v), want its correlation id", kept, err)
	}
	if _, err := e.st.JobGet(ctx, "t", "bad"); err != correlator.ErrNotFound {
		t.Fatalf("bad: %v, want no job (its reply_to is not allowed)", err)
	}
}

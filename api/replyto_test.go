package api

import (
	"testing"

	"github.com/hipq/hipq/correlator"
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

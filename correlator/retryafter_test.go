package correlator

import (
	"testing"
	"time"
)

func TestParseRetryAfter(t *testing.T) {
	at := time.Date(2026, 11, 25, 8, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		in   string
		want RetryAfter
		ok   bool
	}{
		{"3", RetryAfter{Delay: 3 * time.Second}, true},
		{" 1.5 ", RetryAfter{Delay: 1500 * time.Millisecond}, true},
		{"0", RetryAfter{}, true},
		{"Wed, 25 Nov 2026 08:00:00 GMT", RetryAfter{At: at}, true},
		{"2026-11-25T08:00:00Z", RetryAfter{At: at}, true},
		{"99999999999", RetryAfter{Delay: maxRetryAfter}, true},
		{"-1", RetryAfter{}, false},
		{"NaN", RetryAfter{}, false},
		{"soon", RetryAfter{}, false},
	} {
		got, ok := ParseRetryAfter(c.in)
		if ok != c.ok || got.Delay != c.want.Delay || !got.At.Equal(c.want.At) {
			t.Errorf("%q: %+v %v, want %+v %v", c.in, got, ok, c.want, c.ok)
		}
	}
}

// A downstream's Retry-After replaces the policy's delay, within the
// policy's longest delay; it never makes a retry the policy refuses, and
// a retry it pushes past the job's expiry ends the job expired.
func TestRetryAfterSchedulesTheRetry(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	jt := &JobType{Name: "t", Retry: &Backoff{Attempts: 3, Initial: time.Second, Max: time.Minute,
		When: []AttemptOutcome{AttemptFailed, AttemptDispatchError}}}
	run := Running{Attempt: 1, MaxAttempts: 3}
	if r := DispatchFailed(jt, run, "HTTP 429", true, RetryAfter{Delay: 3 * time.Second}, now); r.State != StateRetry || !r.NextRun.Equal(now.Add(3*time.Second)) {
		t.Errorf("429 Retry-After 3: %+v", r)
	}
	if r := DispatchFailed(jt, run, "HTTP 503", true, RetryAfter{At: now.Add(time.Hour)}, now); !r.NextRun.Equal(now.Add(time.Minute)) {
		t.Errorf("a Retry-After past the policy's max: next run %v, want capped at %v", r.NextRun, now.Add(time.Minute))
	}
	if r := Replied(jt, run, &Reply{Error: "busy", Retryable: true, RetryAfter: RetryAfter{Delay: 10 * time.Second}}, now); !r.NextRun.Equal(now.Add(10 * time.Second)) {
		t.Errorf("reply retry_after 10: %+v", r)
	}
	if r := Replied(jt, Running{Attempt: 3, MaxAttempts: 3}, &Reply{Error: "busy", Retryable: true, RetryAfter: RetryAfter{Delay: time.Second}}, now); r.State != StateFinal {
		t.Errorf("Retry-After made a retry the policy has no room for: %+v", r)
	}
	soon := now.Add(5 * time.Second)
	if r := DispatchFailed(jt, Running{Attempt: 1, MaxAttempts: 3, ExpiresAt: &soon}, "HTTP 429", true, RetryAfter{Delay: 30 * time.Second}, now); r.Outcome != OutcomeExpired {
		t.Errorf("a Retry-After past the expiry: %+v", r)
	}
	m := DefaultMatcher()
	r, err := m.Match(&Record{Value: []byte(`{"status": "failed", "retry_after": 7}`), Headers: []Header{{Key: HeaderJobID, Value: []byte("1")}}})
	if err != nil || r.RetryAfter.Delay != 7*time.Second {
		t.Errorf("reply retry_after: %+v %v", r, err)
	}
	if _, err := m.Match(&Record{Value: []byte(`{"status": "failed", "retry_after": "later"}`), Headers: []Header{{Key: HeaderJobID, Value: []byte("1")}}}); err == nil {
		t.Error("an unreadable retry_after was taken")
	}
}

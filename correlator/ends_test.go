package correlator

import (
	"strings"
	"testing"
	"time"
)

// The named ends record how the attempt ended, and follow the type's
// policy, windows and delivery guarantee.
func TestNamedEnds(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	night := TimeWindow{Start: "22:00", End: "23:00", TZ: "UTC"}
	if err := night.Compile(); err != nil {
		t.Fatal(err)
	}
	jt := &JobType{Name: "t", Retry: &Backoff{Attempts: 3, Initial: time.Minute, When: []AttemptOutcome{AttemptFailed, AttemptTimedOut, AttemptDispatchError}},
		Windows: []TimeWindow{night}}
	run := Running{Attempt: 1, MaxAttempts: 3}

	res := TimedOut(jt, run, now)
	if res.State != StateRetry || res.Attempt != AttemptTimedOut || res.AttemptError != ErrorTimeout {
		t.Fatalf("TimedOut: %+v", res)
	}
	if want := time.Date(2026, 1, 1, 22, 0, 0, 0, time.UTC); !res.NextRun.Equal(want) {
		t.Errorf("TimedOut retries at %v, want the type's window %v", res.NextRun, want)
	}
	own := run
	own.Windows = []TimeWindow{} // its own: none, so open all day
	if res := TimedOut(jt, own, now); !res.NextRun.Equal(now.Add(time.Minute)) {
		t.Errorf("a job with its own (empty) windows retried at %v, want %v", res.NextRun, now.Add(time.Minute))
	}
	if res := Replied(jt, run, &Reply{Success: true}, now); res.State != StateFinal || res.Outcome != OutcomeSucceeded ||
		res.Attempt != AttemptSucceeded || res.AttemptError != "" {
		t.Errorf("Replied success: %+v", res)
	}
	if res := Replied(jt, run, &Reply{Error: "no", Retryable: false}, now); res.State != StateFinal || res.Outcome != OutcomeFailed ||
		res.Attempt != AttemptFailed || res.AttemptError != "no" {
		t.Errorf("Replied not retryable: %+v", res)
	}
	if res := DispatchFailed(nil, run, "gone", true, RetryAfter{}, now); res.State != StateFinal || res.Attempt != AttemptDispatchError {
		t.Errorf("DispatchFailed of an unknown type retried: %+v", res)
	}

	for _, c := range []struct {
		jt     *JobType
		resend bool
	}{{nil, true}, {&JobType{Delivery: AtLeastOnce}, true}, {&JobType{}, true}, {&JobType{Delivery: AtMostOnce}, false}} {
		resend, res := SendUnknown(c.jt, "lost")
		if resend != c.resend {
			t.Errorf("SendUnknown(%+v) resend=%v, want %v", c.jt, resend, c.resend)
		}
		if !resend && (res.State != StateFinal || res.Outcome != OutcomeFailed || !strings.HasPrefix(res.Error, "request may have been delivered") ||
			res.Attempt != AttemptDispatchError || res.AttemptError != "lost") {
			t.Errorf("SendUnknown at_most_once: %+v", res)
		}
	}
	if res := ReplyUnstorable("too big"); res.State != StateFinal || res.Outcome != OutcomeFailed || res.Attempt != AttemptFailed ||
		!strings.Contains(res.Error, "too big") {
		t.Errorf("ReplyUnstorable: %+v", res)
	}

	late := now.Add(5 * time.Hour)
	if d := Defer([]TimeWindow{night}, nil, now); d.Expire || d.RunAt.Hour() != 22 {
		t.Errorf("Defer: %+v", d)
	}
	if d := Defer([]TimeWindow{night}, &late, now); !d.Expire {
		t.Errorf("Defer past expiry did not expire: %+v", d)
	}
	if d := Defer(nil, nil, now); !d.RunAt.Equal(now.Add(time.Minute)) {
		t.Errorf("Defer of a job open now: %+v, want a look in a minute", d)
	}
	if got := WindowsFor(jt, nil); len(got) != 1 {
		t.Errorf("WindowsFor without own windows: %v, want the type's", got)
	}
	if got := WindowsFor(nil, nil); got != nil {
		t.Errorf("WindowsFor of an unknown type: %v", got)
	}
}

package correlator

import (
	"testing"
	"time"
)

func TestBackoffSchedule(t *testing.T) {
	half := func() float64 { return 0.5 } // no jitter effect
	tests := []struct {
		name string
		b    Backoff
		want []time.Duration // delays after attempts 1, 2, …
	}{
		{"fixed", Backoff{Attempts: 4, Initial: 5 * time.Second, When: []AttemptOutcome{AttemptFailed}}, []time.Duration{5 * time.Second, 5 * time.Second, 5 * time.Second}},
		{"exponential", Backoff{Attempts: 5, Exponential: true, Initial: 10 * time.Second, Multiplier: 2, Max: time.Hour, When: []AttemptOutcome{AttemptFailed}},
			[]time.Duration{10 * time.Second, 20 * time.Second, 40 * time.Second, 80 * time.Second}},
		{"capped", Backoff{Attempts: 5, Exponential: true, Initial: time.Minute, Multiplier: 10, Max: 5 * time.Minute, When: []AttemptOutcome{AttemptFailed}},
			[]time.Duration{time.Minute, 5 * time.Minute, 5 * time.Minute, 5 * time.Minute}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.b.Rand = half
			for i, want := range tt.want {
				got, ok := tt.b.Next(i+1, AttemptFailed)
				if !ok || got != want {
					t.Errorf("Next(%d) = %v, %v; want %v, true", i+1, got, ok, want)
				}
			}
			if _, ok := tt.b.Next(len(tt.want)+1, AttemptFailed); ok {
				t.Errorf("Next(%d) retried past max_attempts %d", len(tt.want)+1, tt.b.Attempts)
			}
			if _, ok := tt.b.Next(1, AttemptTimedOut); ok {
				t.Error("retried an outcome not in when")
			}
		})
	}
}

func TestBackoffJitterBounds(t *testing.T) {
	for _, r := range []float64{0, 0.25, 0.999} {
		b := Backoff{Attempts: 3, Initial: 100 * time.Second, Jitter: 0.1, When: []AttemptOutcome{AttemptFailed}, Rand: func() float64 { return r }}
		d, _ := b.Next(1, AttemptFailed)
		if d < 90*time.Second || d > 110*time.Second {
			t.Errorf("rand %v: delay %v outside 100s ±10%%", r, d)
		}
	}
}

func TestResolve(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	policy := &Backoff{Attempts: 3, Initial: time.Minute, When: []AttemptOutcome{AttemptFailed, AttemptTimedOut, AttemptDispatchError}}
	soon := now.Add(30 * time.Second)
	tests := []struct {
		name      string
		job       Running
		outcome   AttemptOutcome
		retryable bool
		want      Resolution
	}{
		{"success", Running{Attempt: 1, MaxAttempts: 3}, AttemptSucceeded, true, Resolution{State: StateFinal, Outcome: OutcomeSucceeded, Error: ErrorNone}},
		{"failure retried", Running{Attempt: 1, MaxAttempts: 3}, AttemptFailed, true, Resolution{State: StateRetry, Error: "boom", NextRun: now.Add(time.Minute)}},
		{"not retryable", Running{Attempt: 1, MaxAttempts: 3}, AttemptFailed, false, Resolution{State: StateFinal, Outcome: OutcomeFailed, Error: "boom"}},
		{"exhausted", Running{Attempt: 3, MaxAttempts: 3}, AttemptFailed, true, Resolution{State: StateFinal, Outcome: OutcomeFailed, Error: "boom"}},
		{"timeout exhausted", Running{Attempt: 3, MaxAttempts: 3}, AttemptTimedOut, true, Resolution{State: StateFinal, Outcome: OutcomeTimedOut, Error: "boom"}},
		{"retry past expiry", Running{Attempt: 1, MaxAttempts: 3, ExpiresAt: &soon}, AttemptFailed, true, Resolution{State: StateFinal, Outcome: OutcomeExpired, Error: ErrorExpired}},
		{"dispatch error exhausted", Running{Attempt: 3, MaxAttempts: 3}, AttemptDispatchError, true, Resolution{State: StateFinal, Outcome: OutcomeFailed, Error: "boom"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Resolve(tt.job, tt.outcome, tt.retryable, "boom", policy, now)
			if got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
	if got := Resolve(Running{Attempt: 1, MaxAttempts: 1}, AttemptFailed, true, "x", NoRetry, now); got.State != StateFinal {
		t.Errorf("NoRetry retried: %+v", got)
	}
}

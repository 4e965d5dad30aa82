package correlator

import "time"

// Running is what the retry decision needs to know of a running job.
type Running struct {
	Attempt     int
	MaxAttempts int
	ExpiresAt   *time.Time
	Windows     []TimeWindow // the job's own; nil: its type's
}

// Resolution is the committed result of ending a running attempt: the job
// either ends (StateFinal) or waits for another attempt (StateRetry), and
// the attempt records how it ended.
//
// Every legal end has a name below (Replied, TimedOut, DispatchFailed,
// SendUnknown, ReplyUnstorable): the store writes what they return, guarded
// by state running and the attempt, and builds none of its own.
type Resolution struct {
	State   State
	Outcome Outcome   // set when State is StateFinal
	Error   string    // the job's error column
	NextRun time.Time // set when State is StateRetry
	// Attempt is how the attempt ended (hipq_attempt.outcome) and
	// AttemptError its error (empty on success); set by the named ends.
	Attempt      AttemptOutcome
	AttemptError string
}

// Replied ends an attempt with its reply: success ends the job; a failure
// goes through jt's retry policy unless the reply says it is not
// retryable.
func Replied(jt *JobType, run Running, r *Reply, now time.Time) Resolution {
	outcome := AttemptSucceeded
	if !r.Success {
		outcome = AttemptFailed
	}
	return ended(jt, run, outcome, r.Retryable, r.Error, r.RetryAfter, now)
}

// TimedOut ends an attempt whose reply did not come within the job's
// timeout, through jt's retry policy.
func TimedOut(jt *JobType, run Running, now time.Time) Resolution {
	return ended(jt, run, AttemptTimedOut, true, ErrorTimeout, RetryAfter{}, now)
}

// DispatchFailed ends an attempt whose send failed (cause says how),
// through jt's retry policy when retryable, else for good. after is the
// downstream's Retry-After, when it said one.
func DispatchFailed(jt *JobType, run Running, cause string, retryable bool, after RetryAfter, now time.Time) Resolution {
	return ended(jt, run, AttemptDispatchError, retryable, cause, after, now)
}

// SendUnknown decides a send that may or may not have reached its
// service (a connection lost mid-send, an instance that died between claim
// and send). An at_least_once type sends it again: resend, and the claim is
// to be undone. An at_most_once type never re-sends what may have arrived:
// the attempt ends final / failed.
func SendUnknown(jt *JobType, cause string) (resend bool, res Resolution) {
	if jt == nil || jt.Delivery != AtMostOnce {
		return true, Resolution{}
	}
	msg := "request may have been delivered (at_most_once, not re-sent): " + cause
	return false, Resolution{State: StateFinal, Outcome: OutcomeFailed, Error: msg, Attempt: AttemptDispatchError, AttemptError: cause}
}

// ReplyUnstorable ends an attempt whose reply came but could not be kept
// (PostgreSQL refused it, cause says why): final / failed, never retried,
// since the request did arrive.
func ReplyUnstorable(cause string) Resolution {
	msg := "the reply could not be stored: " + cause
	return Resolution{State: StateFinal, Outcome: OutcomeFailed, Error: msg, Attempt: AttemptFailed, AttemptError: msg}
}

// ended is Resolve under job type jt's policy, its windows standing in
// when the job has none of its own, with the attempt's outcome recorded.
// A nil jt (a type no longer configured) gets no retry.
func ended(jt *JobType, run Running, outcome AttemptOutcome, retryable bool, errText string, after RetryAfter, now time.Time) Resolution {
	var policy RetryPolicy
	if jt != nil {
		policy = jt.Retry
	}
	run.Windows = WindowsFor(jt, run.Windows)
	res := resolve(run, outcome, retryable, errText, policy, after.From(now), now)
	res.Attempt = outcome
	if outcome != AttemptSucceeded {
		res.AttemptError = errText
	}
	return res
}

// Resolve is the retry policy's decision of what follows an attempt that
// ended with outcome. retryable=false (an explicit reply saying so) ends
// the job whatever the policy says. errText is the attempt's error
// (ignored on success).
func Resolve(job Running, outcome AttemptOutcome, retryable bool, errText string, policy RetryPolicy, now time.Time) Resolution {
	return resolve(job, outcome, retryable, errText, policy, time.Time{}, now)
}

// MaxDelayer is a retry policy with a cap on one delay.
type MaxDelayer interface {
	MaxDelay() time.Duration
}

// resolve is Resolve with a downstream's "not before": when the policy
// retries, the next attempt waits until notBefore instead of the policy's
// own delay, capped by the policy's longest delay; windows and expiry
// apply as ever.
func resolve(job Running, outcome AttemptOutcome, retryable bool, errText string, policy RetryPolicy, notBefore, now time.Time) Resolution {
	if outcome == AttemptSucceeded {
		return Resolution{State: StateFinal, Outcome: OutcomeSucceeded, Error: ErrorNone}
	}
	if errText == "" {
		errText = string(outcome)
	}
	final := Resolution{State: StateFinal, Outcome: outcome.JobOutcome(), Error: errText}
	if !retryable || policy == nil || job.Attempt >= job.MaxAttempts {
		return final
	}
	delay, ok := policy.Next(job.Attempt, outcome)
	if !ok {
		return final
	}
	if !notBefore.IsZero() {
		delay = max(notBefore.Sub(now), 0)
		if m, ok := policy.(MaxDelayer); ok && m.MaxDelay() > 0 {
			delay = min(delay, m.MaxDelay())
		}
	}
	next, expired := NextOpening(job.Windows, now.Add(delay), job.ExpiresAt)
	if expired {
		return Resolution{State: StateFinal, Outcome: OutcomeExpired, Error: ErrorExpired}
	}
	return Resolution{State: StateRetry, Error: errText, NextRun: next}
}

// WindowsFor is the time windows that apply to a job: its own when it has
// any (own is not nil), else its type's.
func WindowsFor(jt *JobType, own []TimeWindow) []TimeWindow {
	if own != nil || jt == nil {
		return own
	}
	return jt.Windows
}

// NextOpening is the first instant from from on that windows allow, and
// whether it comes too late: at or past expiresAt, when the job has one.
func NextOpening(windows []TimeWindow, from time.Time, expiresAt *time.Time) (time.Time, bool) {
	next := NextAllowed(windows, from)
	return next, pastExpiry(next, expiresAt)
}

// pastExpiry: a job that would run at t, expiring at expiresAt (nil:
// never), would run too late.
func pastExpiry(t time.Time, expiresAt *time.Time) bool {
	return expiresAt != nil && !t.Before(*expiresAt)
}

// Deferred is a waiting job the claim found due but outside its windows:
// it moves to its next opening without using an attempt, or ends final /
// expired when that opening is past its expiry.
type Deferred struct {
	RunAt  time.Time
	Expire bool
}

// Defer decides the deferral of a job its windows find closed at now, the
// claim's clock. Should the windows have no opening after now (closed at
// now, yet the next opening not later: never, for windows that compiled),
// the job is looked at again in a minute rather than spun on.
func Defer(windows []TimeWindow, expiresAt *time.Time, now time.Time) Deferred {
	next, _ := NextOpening(windows, now, nil)
	var d Deferred
	if !next.After(now) {
		next = now.Add(time.Minute)
	}
	d.RunAt, d.Expire = next, pastExpiry(next, expiresAt)
	return d
}

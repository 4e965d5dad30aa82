package correlator

import "time"

// Running is what the retry decision needs to know of a running job.
type Running struct {
	Attempt     int
	MaxAttempts int
	ExpiresAt   *time.Time
	Windows     []TimeWindow
}

// Resolution is the committed result of resolving an attempt: the job either
// ends (StateFinal) or waits for another attempt (StateRetry).
type Resolution struct {
	State   State
	Outcome Outcome   // set when State is StateFinal
	Error   string    // the job's error column
	NextRun time.Time // set when State is StateRetry
}

// ResolveFor is Resolve under job type jt's policy, its windows standing
// in when the job has none of its own. A nil jt (a type no longer
// configured) gets no retry.
func ResolveFor(jt *JobType, job Running, outcome AttemptOutcome, retryable bool, errText string, now time.Time) Resolution {
	var policy RetryPolicy
	if jt != nil {
		policy = jt.Retry
		if job.Windows == nil {
			job.Windows = jt.Windows
		}
	}
	return Resolve(job, outcome, retryable, errText, policy, now)
}

// Resolve decides what follows an attempt that ended with outcome.
// retryable=false (an explicit reply saying so) ends the job whatever the
// policy says. errText is the attempt's error (ignored on success).
func Resolve(job Running, outcome AttemptOutcome, retryable bool, errText string, policy RetryPolicy, now time.Time) Resolution {
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
	next := NextAllowed(job.Windows, now.Add(delay))
	if job.ExpiresAt != nil && !next.Before(*job.ExpiresAt) {
		return Resolution{State: StateFinal, Outcome: OutcomeExpired, Error: ErrorExpired}
	}
	return Resolution{State: StateRetry, Error: errText, NextRun: next}
}

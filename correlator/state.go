package correlator

import (
	"errors"
	"fmt"
	"time"
)

// State is where a job is in its life. The values are stored as text in
// hipq_job.state.
type State string

const (
	// StateInitial is a job that was accepted and has not been dispatched yet.
	StateInitial State = "initial"
	// StateRunning is a job whose request was (or is being) sent and whose
	// reply is awaited.
	StateRunning State = "running"
	// StateError is transient: the last attempt failed and the retry policy
	// decides, in the same transaction, between StateRetry and StateFinal.
	StateError State = "error"
	// StateRetry is a job waiting for its next attempt.
	StateRetry State = "retry"
	// StateFinal is a job that will never change again.
	StateFinal State = "final"
)

// States are every job state, in lifecycle order.
var States = []State{StateInitial, StateRunning, StateError, StateRetry, StateFinal}

// Outcome says how a final job ended.
type Outcome string

const (
	OutcomeSucceeded Outcome = "succeeded"
	OutcomeFailed    Outcome = "failed"
	OutcomeTimedOut  Outcome = "timed_out"
	OutcomeExpired   Outcome = "expired"
	OutcomeCancelled Outcome = "cancelled"
)

// AttemptOutcome says how one attempt ended (hipq_attempt.outcome).
type AttemptOutcome string

const (
	AttemptSucceeded     AttemptOutcome = "succeeded"
	AttemptFailed        AttemptOutcome = "failed"
	AttemptTimedOut      AttemptOutcome = "timed_out"
	AttemptDispatchError AttemptOutcome = "dispatch_error"
	AttemptCancelled     AttemptOutcome = "cancelled"
)

// ErrorNone is the error column's value when there is no error.
const ErrorNone = "NONE"

// Error strings recorded on jobs by hipq itself.
const (
	ErrorTimeout   = "timeout"
	ErrorExpired   = "expired"
	ErrorCancelled = "cancelled"
)

// JobCount is how many jobs of one queue are in one state.
type JobCount struct {
	Queue string
	State State
	N     int64
}

// RoundTrip is how long one attempt of a job of JobType ran, from its
// claim to its end.
type RoundTrip struct {
	JobType string
	Elapsed time.Duration
}

// ErrNotFound is returned when a job, dead letter or queue does not exist.
var ErrNotFound = errors.New("not found")

// Outcome of an attempt mapped to the outcome a job ends with when no retry
// follows.
func (o AttemptOutcome) JobOutcome() Outcome {
	switch o {
	case AttemptSucceeded:
		return OutcomeSucceeded
	case AttemptTimedOut:
		return OutcomeTimedOut
	case AttemptCancelled:
		return OutcomeCancelled
	default:
		// A failed reply and a dispatch error both end the job failed.
		return OutcomeFailed
	}
}

// ParseAttemptOutcome parses a retry.when entry.
func ParseAttemptOutcome(s string) (AttemptOutcome, error) {
	switch o := AttemptOutcome(s); o {
	case AttemptFailed, AttemptTimedOut, AttemptDispatchError:
		return o, nil
	}
	return "", fmt.Errorf("%q is not one of failed, timed_out, dispatch_error", s)
}

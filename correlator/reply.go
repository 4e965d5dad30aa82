package correlator

import "encoding/json"

// Reply is a response read from a response topic or an HTTP callback, its
// fields extracted by a matcher.
type Reply struct {
	JobID     *int64 // fences the reply to one row when present
	JobType   string
	JobKey    string
	Attempt   *int // fences the reply to one attempt when present
	Success   bool
	Retryable bool
	Error     string
	Result    json.RawMessage
}

// Target is the job row a reply was matched to.
type Target struct {
	ID      int64
	JobType string
	JobKey  string
	State   State
	Attempt int
}

// Verdict is what becomes of a reply.
type Verdict int

const (
	// Apply: the reply resolves the target's running attempt.
	Apply Verdict = iota
	// Duplicate: the job already ended; ignored and counted.
	Duplicate
	// Stale: the reply is for an attempt already resolved or a pruned job;
	// ignored and counted.
	Stale
	// Early: the job has not been dispatched yet; the reply is kept until it
	// is, or until its TTL passes.
	Early
	// DeadLetter: the reply cannot be used.
	DeadLetter
)

func (v Verdict) String() string {
	return [...]string{"applied", "duplicate", "stale", "early", "dead_letter"}[v]
}

// Decision is a Verdict with, for DeadLetter, the reason.
type Decision struct {
	Verdict Verdict
	Reason  *InputError
}

// Classify applies the reply table of SPEC §6. target is the row the reply
// names: the row of its job id when it carries one, else the non-final job
// of its (type, key); nil when there is none. finalExists says, for a reply
// without job id and no non-final job, whether a final job of that (type,
// key) exists.
func Classify(r *Reply, target *Target, finalExists bool) Decision {
	if target == nil {
		switch {
		case r.JobID != nil:
			// The id's row was pruned: the job ended long ago.
			return Decision{Verdict: Stale}
		case finalExists:
			return Decision{Verdict: Duplicate}
		}
		return Decision{Verdict: Early}
	}
	if r.JobID != nil && (r.JobType != "" && r.JobType != target.JobType || r.JobKey != "" && r.JobKey != target.JobKey) {
		return Decision{Verdict: DeadLetter, Reason: inputErrorf(CodeMismatch,
			"job id %d belongs to %s/%s, not %s/%s", target.ID, target.JobType, target.JobKey, r.JobType, r.JobKey)}
	}
	newer := func() Decision {
		return Decision{Verdict: DeadLetter, Reason: inputErrorf(CodeNewerAttempt,
			"reply for attempt %d, but job %d is %s at attempt %d", *r.Attempt, target.ID, target.State, target.Attempt)}
	}
	switch target.State {
	case StateFinal:
		return Decision{Verdict: Duplicate}
	case StateRunning:
		switch {
		case r.Attempt == nil || *r.Attempt == target.Attempt:
			return Decision{Verdict: Apply}
		case *r.Attempt < target.Attempt:
			return Decision{Verdict: Stale}
		}
		return newer()
	case StateRetry:
		if r.Attempt == nil || *r.Attempt <= target.Attempt {
			return Decision{Verdict: Stale}
		}
		return newer()
	case StateInitial:
		if r.Attempt == nil || *r.Attempt == 1 {
			return Decision{Verdict: Early}
		}
		return newer()
	}
	return Decision{Verdict: DeadLetter, Reason: inputErrorf(CodeNoJob, "job %d is in unexpected state %q", target.ID, target.State)}
}

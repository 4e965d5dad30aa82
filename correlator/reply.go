package correlator

import (
	"encoding/json"
	"fmt"
	"time"
)

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
	// RetryAfter, with a failure: the next attempt waits until it allows
	// (within the policy's longest delay).
	RetryAfter RetryAfter
	// Progress: news of a running attempt, not its end: it moves the
	// attempt's deadline and records Result as its progress.
	Progress bool
}

// Target is the job row a reply was matched to.
type Target struct {
	Queue   string
	ID      int64
	JobType string
	JobKey  string
	State   State
	Attempt int
	// What the retry decision needs besides the attempt.
	MaxAttempts int
	ExpiresAt   *time.Time
	Windows     []TimeWindow // the job's own; nil: its type's
	// What a progress reply needs: when the attempt started, the job's
	// timeout, and the attempt's deadline (zero: started + timeout).
	StartedAt time.Time
	Timeout   time.Duration
	Deadline  time.Time
}

// CurrentDeadline is when the running attempt times out.
func (t *Target) CurrentDeadline() time.Time {
	if !t.Deadline.IsZero() {
		return t.Deadline
	}
	return t.StartedAt.Add(t.Timeout)
}

// Running is what the retry decision needs of the target.
func (t *Target) Running() Running {
	return Running{Attempt: t.Attempt, MaxAttempts: t.MaxAttempts, ExpiresAt: t.ExpiresAt, Windows: t.Windows}
}

// TypeKey names the jobs of one (job_type, job_key).
type TypeKey struct{ Type, Key string }

// Targets are the rows a batch of replies names, read (and locked) by the
// store before the batch is decided.
type Targets struct {
	ByID   map[int64]*Target   // every row named by a reply's job id
	ByKey  map[TypeKey]*Target // the non-final job of each (type, key) named
	Finals map[TypeKey]bool    // (type, key) named without a non-final job, that have a final one
}

// Of is the row a reply names: its job id's, else the non-final job of its
// (type, key); nil when there is none.
func (t Targets) Of(r *Reply) *Target {
	if r.JobID != nil {
		return t.ByID[*r.JobID]
	}
	return t.ByKey[TypeKey{r.JobType, r.JobKey}]
}

// Pending is one reply of a batch: fresh (from a response topic, a
// callback, a sync send) or kept earlier as an early reply until KeptUntil.
type Pending struct {
	Reply     *Reply
	Kept      bool
	KeptUntil time.Time
}

// ReplyDecision is what becomes of one reply of a batch.
type ReplyDecision struct {
	Decision
	// Target and Res, with Apply: the job's running attempt ends so.
	Target *Target
	Res    Resolution
	// KeepUntil, with Early for a fresh reply: it is kept until then.
	KeepUntil time.Time
	// Drop: a kept reply that is now used up (applied, ignored, or
	// dead-lettered once its TTL passed).
	Drop bool
	// Deadline, with Progressed: the attempt's new deadline.
	Deadline time.Time
}

// DecideReplies decides a whole batch of replies against their targets
// (SPEC §6) on now, the database's clock: each is applied, a duplicate,
// stale, early (a fresh one kept for earlyTTL) or dead-lettered with its
// reason. A reply to a job type not configured here is dead-lettered; of
// several replies applying to one job in the batch the first applies and
// the others are duplicates; a kept reply past its TTL is dead-lettered.
// It does no I/O: the store reads the targets, calls it once, and writes
// what it returns.
func DecideReplies(batch []Pending, t Targets, types Types, now time.Time, earlyTTL time.Duration) []ReplyDecision {
	out := make([]ReplyDecision, len(batch))
	applied := map[int64]bool{}
	for i, p := range batch {
		r := p.Reply
		target := t.Of(r)
		name := r.JobType
		if target != nil {
			name = target.JobType
		}
		d := ReplyDecision{Target: target}
		jt := types.Get(name)
		switch {
		case jt == nil && name != "":
			// (A reply by job id alone to a pruned row names no type: it
			// is stale, as Classify says.)
			d.Decision = Decision{Verdict: DeadLetter, Reason: &InputError{Code: CodeUnknownJobType,
				Detail: fmt.Sprintf("job type %q is not configured", name)}}
		default:
			d.Decision = Classify(r, target, t.Finals[TypeKey{r.JobType, r.JobKey}])
		}
		if d.Verdict == Apply && applied[target.ID] {
			d.Decision = Decision{Verdict: Duplicate}
		}
		if r.Progress {
			d = progressed(d, jt, now)
		}
		switch d.Verdict {
		case Apply:
			applied[target.ID] = true
			d.Res = Replied(jt, target.Running(), r, now)
		case Early:
			switch {
			case !p.Kept:
				d.KeepUntil = now.Add(earlyTTL)
			case now.After(p.KeptUntil):
				d.Decision = Decision{Verdict: DeadLetter, Reason: &InputError{Code: CodeNoJob,
					Detail: "no job was dispatched for this reply within responses.early_ttl"}}
			}
		}
		d.Drop = p.Kept && d.Verdict != Early
		out[i] = d
	}
	return out
}

// progressed turns the decision on a progress reply into what news of a
// running attempt does: an attempt it would apply to gets a later
// deadline (Progressed), unless its deadline has passed (the timeout wins:
// Stale); one not yet dispatched or already over is counted, never kept
// nor dead-lettered. A reply that cannot be used is dead-lettered as any.
func progressed(d ReplyDecision, jt *JobType, now time.Time) ReplyDecision {
	switch d.Verdict {
	case Apply:
		cur := d.Target.CurrentDeadline()
		if now.After(cur) {
			return ReplyDecision{Decision: Decision{Verdict: Stale}, Target: d.Target}
		}
		d.Verdict, d.Deadline = Progressed, jt.Extend(d.Target.StartedAt, d.Target.Timeout, cur, now)
	case Early:
		d.Verdict = Stale
	}
	return d
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
	// Progressed: news of the running attempt moved its deadline.
	Progressed
)

func (v Verdict) String() string {
	return [...]string{"applied", "duplicate", "stale", "early", "dead_letter", "progress"}[v]
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

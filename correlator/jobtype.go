package correlator

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"
)

// Defaults of a job type.
const (
	DefaultQueue          = "default" // exists without being declared
	DefaultJobTimeout     = 24 * time.Hour
	DefaultPriority       = 100
	DefaultThrottleFactor = 1
	DefaultDelivery       = AtLeastOnce
)

// Delivery is a job type's dispatch guarantee.
type Delivery string

const (
	// AtLeastOnce re-sends when hipq cannot know whether a request arrived.
	AtLeastOnce Delivery = "at_least_once"
	// AtMostOnce never re-sends a request that may have arrived.
	AtMostOnce Delivery = "at_most_once"
)

// JobType is a named kind of job with its defaults and policies.
type JobType struct {
	Name           string
	Queue          string
	Timeout        time.Duration // how long a running job waits for its reply (0: DefaultJobTimeout)
	Priority       int
	ThrottleFactor int
	Delivery       Delivery
	Retry          RetryPolicy
	Windows        []TimeWindow // compiled
	// QueueLimit is the queue's throttle_limit (0 = unlimited): a job heavier
	// than it could never run and is refused at intake.
	QueueLimit int
	// Shares are the queue's: a job heavier than its partition's cap could
	// never run either.
	Shares *Shares
	// Critical types count against neither the queue limit nor shares.
	Critical bool
	// MaxConcurrency caps running jobs of the type; 0 = no cap.
	MaxConcurrency int
	// CheckData validates job_data against the type's data_schema (nil:
	// none); its error says where the data fails.
	CheckData func(data []byte) error
	// SendTimeout bounds one send of the type's requests (0:
	// DefaultSendTimeout); a claim not known to be sent after it plus
	// dispatch.grace is taken for lost by the sweeper.
	SendTimeout time.Duration
	// HeartbeatTimeout is how long a running job waits after news (a
	// progress reply, a heartbeat); 0: the job's timeout.
	HeartbeatTimeout time.Duration
	// MaxTimeout caps a running attempt from its start whatever news
	// comes; 0: the job's timeout, so news extends nothing.
	MaxTimeout time.Duration
	// Events says where the type's outcome events go (zero: nowhere).
	Events Events
	// AllowedReplyTo are the patterns (events.allowed_reply_to) a job's
	// own reply_to topic must match; none: no job may name one.
	AllowedReplyTo []string
}

// Extend is an attempt's deadline after news at now: now plus the
// heartbeat timeout (or the job's timeout), never past startedAt plus
// the max timeout (at least the job's timeout), and never earlier than
// current, the deadline it had.
func (jt *JobType) Extend(startedAt time.Time, timeout time.Duration, current, now time.Time) time.Time {
	step, limit := timeout, timeout
	if jt != nil && jt.HeartbeatTimeout > 0 {
		step = jt.HeartbeatTimeout
	}
	if jt != nil && jt.MaxTimeout > limit {
		limit = jt.MaxTimeout
	}
	d := now.Add(step)
	if hard := startedAt.Add(limit); d.After(hard) {
		d = hard
	}
	if d.Before(current) {
		return current
	}
	return d
}

// DefaultSendTimeout bounds a send whose type names no bound of its own:
// the Kafka transport's record delivery timeout.
const DefaultSendTimeout = 30 * time.Second

// SendBound is how long one send of the type may take.
func (jt *JobType) SendBound() time.Duration {
	if jt == nil || jt.SendTimeout <= 0 {
		return DefaultSendTimeout
	}
	return jt.SendTimeout
}

// Types is the job-type registry: built once from the config and handed
// to every role, so each reads the same policies.
type Types map[string]*JobType

// Get returns the named type, nil when it is not configured here.
func (t Types) Get(name string) *JobType { return t[name] }

// Names lists the types' names, sorted.
func (t Types) Names() []string { return slices.Sorted(maps.Keys(t)) }

// Job is one row of hipq_job.
type Job struct {
	ID               int64
	Queue            string
	JobType          string
	JobKey           string
	JobData          json.RawMessage
	State            State
	Outcome          Outcome // empty until final
	Error            string
	Attempt          int
	MaxAttempts      int
	ScheduledRunTime time.Time
	Priority         int
	ThrottleFactor   int
	TimeWindows      []TimeWindow // nil = the type's
	TimeoutSeconds   int
	ExpiresAt        *time.Time
	StartedAt        *time.Time
	Result           json.RawMessage
	CreatedAt        time.Time
	UpdateTime       time.Time
	// Trace is the trace context the job came in with (none: zero).
	Trace TraceContext
	// ReplyTo is the topic the job's final event goes to, besides its
	// type's events topic (empty: none), as its producer asked.
	ReplyTo string
	// Correlation are the hipq-correlation-* headers the job came with,
	// which its events carry back.
	Correlation []Header
}

// DecodeJob decodes an intake record's value into the job it asks for:
// the request is validated and its type must be one of types. Errors are
// *InputError.
func DecodeJob(value []byte, maxBytes int, types Types, now time.Time) (*Job, error) {
	req, err := DecodeRequest(value, maxBytes)
	if err != nil {
		return nil, err
	}
	jt := types[req.JobType]
	if jt == nil {
		return nil, &InputError{Code: CodeUnknownJobType,
			Detail: fmt.Sprintf("job type %q is not configured on this instance", req.JobType)}
	}
	return NewJob(req, jt, now)
}

// NewJob builds the initial row for a decoded request of type jt, filling
// defaults from the type. It refuses what could never run.
func NewJob(req *Request, jt *JobType, now time.Time) (*Job, error) {
	j := &Job{
		Queue:          jt.Queue,
		JobType:        req.JobType,
		JobKey:         req.JobKey,
		JobData:        req.JobData,
		State:          StateInitial,
		Error:          ErrorNone,
		MaxAttempts:    1,
		Priority:       jt.Priority,
		ThrottleFactor: jt.ThrottleFactor,
		TimeoutSeconds: int(jt.Timeout / time.Second),
		ExpiresAt:      req.ExpiresAt,
		TimeWindows:    req.TimeWindows,
	}
	if jt.Retry != nil {
		j.MaxAttempts = jt.Retry.MaxAttempts()
	}
	if len(j.JobData) == 0 {
		j.JobData = json.RawMessage("null")
	}
	if jt.CheckData != nil {
		if err := jt.CheckData(j.JobData); err != nil {
			return nil, &InputError{Code: CodeSchemaViolation, Field: "job_data", Detail: Clip(err.Error(), MaxDetailBytes)}
		}
	}
	if req.Priority != nil {
		j.Priority = *req.Priority
	}
	if req.ThrottleFactor != nil {
		j.ThrottleFactor = *req.ThrottleFactor
	}
	if req.TimeoutSeconds != nil {
		j.TimeoutSeconds = *req.TimeoutSeconds
	}
	if j.TimeoutSeconds <= 0 {
		j.TimeoutSeconds = int(DefaultJobTimeout / time.Second)
	}
	if j.ThrottleFactor < 1 {
		j.ThrottleFactor = DefaultThrottleFactor
	}
	if err := jt.fits(j); err != nil {
		return nil, err
	}
	windows := WindowsFor(jt, req.TimeWindows)
	if req.ScheduledRunTime == nil && len(windows) == 0 {
		// Due at once: the zero time stands for the database's now() at
		// the insert, the clock the claim compares it with.
		return j, nil
	}
	start := now
	if req.ScheduledRunTime != nil {
		start = *req.ScheduledRunTime
	}
	j.ScheduledRunTime = NextAllowed(windows, start)
	return j, nil
}

// fits refuses a job too heavy ever to run: a throttle_factor above its
// queue's limit or its share partition's cap. Critical types count against
// neither.
func (jt *JobType) fits(j *Job) error {
	if jt.Critical {
		return nil
	}
	if jt.QueueLimit > 0 && j.ThrottleFactor > jt.QueueLimit {
		return inputErrorf(CodeInvalidField, "throttle_factor: %d is larger than queue %q's throttle_limit %d, so the job could never run", j.ThrottleFactor, jt.Queue, jt.QueueLimit)
	}
	if jt.Shares != nil {
		if part, limit := jt.Shares.Partition(j.JobData); limit > 0 && j.ThrottleFactor > limit {
			return inputErrorf(CodeInvalidField, "throttle_factor: %d is larger than the share of partition %q (%s = %d) in queue %q, so the job could never run", j.ThrottleFactor, part, jt.Shares.Pointer, limit, jt.Queue)
		}
	}
	return nil
}

// Due reports whether the job, waiting, may run at now: its time has come
// (a zero ScheduledRunTime is at once) and it has not expired. (In SQL,
// on PostgreSQL's clock, the store's dueSQL says the same.)
func (j *Job) Due(now time.Time) bool {
	return !j.ScheduledRunTime.After(now) && (j.ExpiresAt == nil || j.ExpiresAt.After(now))
}

// ClaimableAtIntake reports whether the new job may be claimed as it is
// stored, as far as the job alone decides: due at now, and no time
// windows of its own (the windows of its type, its queue's limits and the
// room of the instance that would send it are its queue's and type's to
// decide).
func (j *Job) ClaimableAtIntake(now time.Time) bool {
	return j.TimeWindows == nil && j.Due(now)
}

// Package dispatcher claims due jobs in batches and sends their requests.
//
// A round claims up to BatchSize due jobs of a queue in one statement
// (FOR UPDATE SKIP LOCKED: many instances never claim the same job), which
// moves them to running and writes their hipq_attempt rows, and commits.
// Only then are the requests sent. A send the transport acknowledges sets
// sent_at. A send the Kafka broker refused never left, so its claim is
// undone (invariant 8) and the dispatcher backs off that transport instead
// of burning attempts. An instance that dies between claim and send leaves
// claims without sent_at, which the sweeper undoes after the send timeout
// plus dispatch.grace.
package dispatcher

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// Sender sends the requests of claimed jobs. Every claim gets exactly one
// Result.
type Sender interface {
	Send(ctx context.Context, jobs []store.Claimed) []Result
	// Transport names it in metrics: kafka, http.
	Transport() string
}

// SendStatus is what became of one send.
type SendStatus int

const (
	// Sent: the transport acknowledged the request.
	Sent SendStatus = iota
	// NotSent: the request surely never left (a broker refused it); the
	// claim is undone.
	NotSent
	// Unknown: the request may have left (timeout, connection lost).
	// at_least_once types undo the claim and send again; at_most_once types
	// end final / failed.
	Unknown
	// Failed: the request itself is at fault or the downstream failed it; a
	// dispatch_error attempt for the retry policy.
	Failed
)

// Result is the outcome of one send.
type Result struct {
	Status SendStatus
	Err    error
	// Final, with Failed: the attempt is not retried whatever the policy
	// says (a 4xx, or a send of an at_most_once type that may have
	// arrived).
	Final bool
	// Reply, with Sent: the reply came with the send (HTTP sync mode).
	Reply *correlator.Reply
}

// QueueConfig is one queue the dispatcher serves.
type QueueConfig struct {
	Name     string
	Order    string
	Throttle correlator.Throttle
}

// Config configures a dispatcher.
type Config struct {
	Instance  string
	Interval  time.Duration // poll interval; defaults to 1s
	BatchSize int           // defaults to 500
	// MaxInFlight bounds the claimed jobs whose sends are not yet
	// recorded; defaults to 4 × BatchSize. Sends are recorded as they
	// finish, so a slow downstream holds its own jobs, not the next claim.
	MaxInFlight int
	Queues      []QueueConfig
	Types       map[string]*correlator.JobType
	// Senders by job type.
	Senders map[string]Sender
	// Metrics receives the dispatcher's counts; nil = not served.
	Metrics *metrics.Metrics
}

// Dispatcher claims and sends.
type Dispatcher struct {
	log  *zap.Logger
	st   *store.Store
	cfg  Config
	wake chan struct{}
	// typeWindows are the job types' time windows, for the claim.
	typeWindows map[string][]correlator.TimeWindow

	inflight atomic.Int64   // claimed jobs whose sends are not recorded yet
	sends    sync.WaitGroup // deliveries running
	mu       sync.Mutex
	errs     []error              // of deliveries, for the next RunOnce to return
	pausedTo map[Sender]time.Time // transports backing off after a refused send
	failures map[Sender]int
	m        *metrics.Metrics
}

// New builds a dispatcher; Run starts it.
func New(log *zap.Logger, st *store.Store, cfg Config) *Dispatcher {
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 500
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = 4 * cfg.BatchSize
	}
	tw := map[string][]correlator.TimeWindow{}
	for name, jt := range cfg.Types {
		if len(jt.Windows) > 0 {
			tw[name] = jt.Windows
		}
	}
	return &Dispatcher{log: log.Named("dispatcher"), st: st, cfg: cfg, wake: make(chan struct{}, 1), typeWindows: tw,
		pausedTo: map[Sender]time.Time{}, failures: map[Sender]int{}, m: metrics.Or(cfg.Metrics)}
}

func add(c prometheus.Counter, n int) {
	if n > 0 {
		c.Add(float64(n))
	}
}

// Wake asks for a round now.
func (d *Dispatcher) Wake() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// Run claims and sends every Interval, and at once when PostgreSQL notifies
// new work or a send finishes, until ctx ends. Sends in flight finish and
// are recorded before Run returns.
func (d *Dispatcher) Run(ctx context.Context) error {
	go d.listen(ctx)
	t := time.NewTicker(d.cfg.Interval)
	defer t.Stop()
	for {
		// Deliveries run to their end even during shutdown: what was claimed is sent and recorded.
		if _, err := d.claimAll(context.WithoutCancel(ctx)); err != nil {
			d.log.Error("dispatch round failed", zap.Error(err))
		}
		if err := d.takeErrs(); err != nil {
			d.log.Error("recording sends failed", zap.Error(err))
		}
		select {
		case <-ctx.Done():
			d.sends.Wait()
			if err := d.takeErrs(); err != nil {
				d.log.Error("recording sends failed", zap.Error(err))
			}
			return nil
		case <-t.C:
		case <-d.wake:
		}
	}
}

// listen turns NOTIFY hipq_job_ready into wake-ups. It is only a hint:
// polling stays the fallback, so errors are logged and retried.
func (d *Dispatcher) listen(ctx context.Context) {
	for ctx.Err() == nil {
		err := func() error {
			conn, err := d.st.Pool().Acquire(ctx)
			if err != nil {
				return err
			}
			defer conn.Release()
			if _, err := conn.Exec(ctx, "LISTEN hipq_job_ready"); err != nil {
				return err
			}
			defer conn.Exec(context.Background(), "UNLISTEN *") //nolint:errcheck
			for {
				if _, err := conn.Conn().WaitForNotification(ctx); err != nil {
					return err
				}
				d.Wake()
			}
		}()
		if ctx.Err() != nil {
			return
		}
		d.log.Debug("listen for new jobs failed; polling meanwhile", zap.Error(err))
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// RunOnce claims and sends until no queue has due work left (or every
// transport with due work is backing off), and waits until every send is
// recorded. It returns how many jobs it claimed or rescheduled.
func (d *Dispatcher) RunOnce(ctx context.Context) (int, error) {
	n, err := d.claimAll(ctx)
	d.sends.Wait()
	return n, errors.Join(err, d.takeErrs())
}

func (d *Dispatcher) takeErrs() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	err := errors.Join(d.errs...)
	d.errs = nil
	return err
}

// claimAll claims batches, queue after queue, while due work and room in
// flight are left, and starts their deliveries.
func (d *Dispatcher) claimAll(ctx context.Context) (int, error) {
	total := 0
	var errs []error
	for _, q := range d.cfg.Queues {
		for {
			n, more, err := d.round(ctx, q)
			total += n
			if err != nil {
				errs = append(errs, err)
				break
			}
			if !more || ctx.Err() != nil {
				break // drained, or no room left in flight
			}
		}
	}
	return total, errors.Join(errs...)
}

// round claims one batch of a queue (as much as there is room for in
// flight) and starts its deliveries, one per transport. It returns how many
// jobs it claimed or rescheduled, and whether the batch was full (more may
// be due).
func (d *Dispatcher) round(ctx context.Context, q QueueConfig) (int, bool, error) {
	if d.allPaused(q) {
		return 0, false, nil
	}
	limit := min(d.cfg.BatchSize, d.cfg.MaxInFlight-int(d.inflight.Load()))
	if limit <= 0 {
		return 0, false, nil // a delivery finishing wakes the dispatcher
	}
	claim, err := d.st.JobClaim(ctx, store.JobClaimParams{Queue: q.Name, Order: q.Order, Limit: limit,
		Instance: d.cfg.Instance, Types: d.sendable(q), Throttle: q.Throttle, TypeWindows: d.typeWindows})
	if err != nil {
		return 0, false, err
	}
	if err := d.deferClosed(ctx, q, claim.Closed); err != nil {
		return 0, false, err
	}
	claimed := claim.Jobs
	n := len(claimed) + len(claim.Closed)
	more := n == limit
	if len(claimed) == 0 {
		return n, more, nil
	}
	add(d.m.Claimed.WithLabelValues(q.Name), len(claimed))
	bySender := map[Sender][]store.Claimed{}
	var orphans []store.AttemptRef
	for _, c := range claimed {
		s := d.cfg.Senders[c.JobType]
		if s == nil || d.paused(s) {
			// The transport started backing off during this round: give
			// the claim back.
			orphans = append(orphans, store.AttemptRef{JobID: c.ID, Attempt: c.Attempt})
			continue
		}
		bySender[s] = append(bySender[s], c)
	}
	if err := d.undo(ctx, q, orphans); err != nil {
		return n, more, err
	}
	for s, jobs := range bySender {
		d.inflight.Add(int64(len(jobs)))
		d.sends.Add(1)
		go func() {
			defer d.sends.Done()
			err := d.deliver(ctx, q, s, jobs)
			d.inflight.Add(-int64(len(jobs)))
			if err != nil {
				d.mu.Lock()
				d.errs = append(d.errs, err)
				d.mu.Unlock()
			}
			d.Wake()
		}()
	}
	return n, more, nil
}

// deliver sends one transport's share of a claim and records each outcome:
// sent_at, undone claims, dispatch errors through the retry policy, replies
// that came with the send, and early replies waiting for these jobs.
func (d *Dispatcher) deliver(ctx context.Context, q QueueConfig, s Sender, jobs []store.Claimed) error {
	results := s.Send(ctx, jobs)
	now := time.Now()
	var (
		sent, undo []store.AttemptRef
		resolves   []store.Resolve
		replies    []store.ReplyIn
		refused    int
		byStatus   [Failed + 1]int
	)
	for i, r := range results {
		c := &jobs[i]
		ref := store.AttemptRef{JobID: c.ID, Attempt: c.Attempt}
		jt := d.cfg.Types[c.JobType]
		byStatus[r.Status]++
		switch r.Status {
		case Sent:
			sent = append(sent, ref)
			if r.Reply != nil {
				replies = append(replies, store.ReplyIn{Reply: r.Reply, Kind: store.SourceCallback,
					Source: store.Source{Value: r.Reply.Result}})
			}
		case NotSent:
			refused++
			undo = append(undo, ref)
		case Unknown:
			if jt != nil && jt.Delivery == correlator.AtMostOnce {
				resolves = append(resolves, store.Resolve{JobID: c.ID, Attempt: c.Attempt,
					AttemptOutcome: correlator.AttemptDispatchError, AttemptError: errText(r.Err),
					Res: correlator.Resolution{State: correlator.StateFinal, Outcome: correlator.OutcomeFailed,
						Error: "request may have been delivered (at_most_once, not re-sent): " + errText(r.Err)}})
			} else {
				refused++
				undo = append(undo, ref)
			}
		case Failed:
			resolves = append(resolves, dispatchError(c, jt, r.Err, !r.Final, now))
		}
	}
	d.backoff(s, refused)
	for st, result := range [...]string{Sent: "sent", NotSent: "refused", Unknown: "unknown", Failed: "failed"} {
		add(d.m.Dispatches.WithLabelValues(q.Name, s.Transport(), result), byStatus[st])
	}
	var errs []error
	if err := d.st.AttemptMarkSent(ctx, sent); err != nil {
		errs = append(errs, err)
	}
	if err := d.undo(ctx, q, undo); err != nil {
		errs = append(errs, err)
	}
	if len(resolves) > 0 {
		if _, err := d.st.JobResolveMany(ctx, resolves); err != nil {
			errs = append(errs, err)
		}
	}
	if len(replies) > 0 {
		if res, err := d.st.ReplyApply(ctx, store.ReplyBatch{Replies: replies}, d.typeInfo); err != nil {
			errs = append(errs, err)
		} else {
			d.m.ObserveReplies(metrics.SourceSync, res)
		}
	}
	// Replies that came before their job was dispatched apply now.
	if len(sent) > 0 {
		ids := make([]int64, len(sent))
		for i, r := range sent {
			ids[i] = r.JobID
		}
		if res, err := d.st.EarlyReplyApply(ctx, ids, 0, d.typeInfo); err != nil {
			errs = append(errs, err)
		} else {
			d.m.ObserveReplies(metrics.SourceEarly, res)
			if n := res.Counts[correlator.Apply]; n > 0 {
				d.log.Info("early replies applied", zap.Int("replies", n))
			}
		}
	}
	return errors.Join(errs...)
}

// undo takes back claims whose requests never left (invariant 8).
func (d *Dispatcher) undo(ctx context.Context, q QueueConfig, refs []store.AttemptRef) error {
	n, err := d.st.JobUndoClaim(ctx, refs)
	if err != nil {
		return err
	}
	if n > 0 {
		d.log.Warn("claims undone: their requests never left", zap.String("queue", q.Name), zap.Int("jobs", n))
	}
	return nil
}

func (d *Dispatcher) typeInfo(name string) *correlator.JobType { return d.cfg.Types[name] }

// dispatchError resolves a failed send through the retry policy (not
// retried at all unless retryable).
func dispatchError(c *store.Claimed, jt *correlator.JobType, err error, retryable bool, now time.Time) store.Resolve {
	return store.Resolve{JobID: c.ID, Attempt: c.Attempt, AttemptOutcome: correlator.AttemptDispatchError,
		AttemptError: errText(err),
		Res:          correlator.ResolveFor(jt, c.Running(), correlator.AttemptDispatchError, retryable, errText(err), now)}
}

func errText(err error) string {
	if err == nil {
		return "dispatch_error"
	}
	return err.Error()
}

// backoff pauses a transport whose sends were refused, longer each time; a
// round without refusals ends the pause.
func (d *Dispatcher) backoff(s Sender, refused int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if refused == 0 {
		if d.failures[s] > 0 {
			d.log.Info("transport delivers again; claiming resumes")
		}
		d.failures[s] = 0
		delete(d.pausedTo, s)
		return
	}
	d.failures[s]++
	wait := min(time.Second<<min(d.failures[s]-1, 5), 30*time.Second)
	d.pausedTo[s] = time.Now().Add(wait)
	d.log.Warn("transport refused sends; pausing its claims", zap.Int("refused", refused), zap.Duration("for", wait))
}

func (d *Dispatcher) paused(s Sender) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return time.Now().Before(d.pausedTo[s])
}

// sendable lists the queue's job types that have a transport here, so an
// instance never claims what it cannot send (a type rolling out, or a
// transport this build lacks).
func (d *Dispatcher) sendable(q QueueConfig) []string {
	out := []string{}
	for name, jt := range d.cfg.Types {
		if jt.Queue == q.Name && d.cfg.Senders[name] != nil {
			out = append(out, name)
		}
	}
	return out
}

// allPaused reports whether every transport of the queue's types is
// backing off, so claiming would only be undone.
func (d *Dispatcher) allPaused(q QueueConfig) bool {
	any := false
	for name, jt := range d.cfg.Types {
		if jt.Queue != q.Name {
			continue
		}
		if s := d.cfg.Senders[name]; s != nil && !d.paused(s) {
			return false
		}
		any = true
	}
	return any
}

// deferClosed moves due jobs found outside their time windows to their next
// opening without using an attempt, or ends them final / expired when that
// opening is past their expiry (they are never sent).
func (d *Dispatcher) deferClosed(ctx context.Context, q QueueConfig, closed []store.Closed) error {
	if len(closed) == 0 {
		return nil
	}
	now := time.Now()
	ds := make([]store.Deferral, 0, len(closed))
	expired := 0
	for _, c := range closed {
		ws := c.TimeWindows
		if ws == nil {
			if jt := d.cfg.Types[c.JobType]; jt != nil {
				ws = jt.Windows
			}
		}
		next := correlator.NextAllowed(ws, now)
		if !next.After(now) {
			// PostgreSQL found it closed, Go finds it open (time zone data
			// differ): look again in a minute rather than spin on it.
			d.log.Warn("time window open here but closed in PostgreSQL; retrying in a minute",
				zap.Int64("job_id", c.ID), zap.String("job_type", c.JobType))
			next = now.Add(time.Minute)
		}
		expire := c.ExpiresAt != nil && !next.Before(*c.ExpiresAt)
		if expire {
			expired++
		}
		ds = append(ds, store.Deferral{ID: c.ID, State: c.State, Attempt: c.Attempt, RunAt: next, Expire: expire})
	}
	n, err := d.st.JobDefer(ctx, ds)
	if err != nil {
		return err
	}
	add(d.m.Deferred.WithLabelValues(q.Name, "deferred"), n-expired)
	add(d.m.Deferred.WithLabelValues(q.Name, "expired"), expired)
	d.log.Debug("jobs outside their time windows rescheduled", zap.String("queue", q.Name),
		zap.Int("jobs", n), zap.Int("expired", expired))
	return nil
}

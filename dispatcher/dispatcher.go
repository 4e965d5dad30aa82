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
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// Sender sends the requests of claimed jobs. Every claim gets exactly one
// Result.
type Sender interface {
	Send(ctx context.Context, jobs []store.Claimed) []Result
	// Transport names it in metrics: kafka, http.
	Transport() string
	// Route says where a job type's requests go.
	Route(jobType string) Route
}

// Route is where one job type's requests go, as the dispatcher sees it.
type Route struct {
	// Neighbour names what the requests reach (a topic, a downstream
	// host): what backs off when it refuses, apart from every other.
	Neighbour string
	// Destination names it in traces: the topic, the host.
	Destination string
	// Timeout is how long one send may take. A refusal that has lasted
	// longer than this is no longer taken for a passing outage: the
	// attempt ends as a dispatch error and the retry policy decides.
	Timeout time.Duration
	// MaxInFlight bounds the type's sends at once (0: unbounded); the
	// dispatcher claims no more of the type while it is reached.
	MaxInFlight int
}

// SendStatus is what became of one send.
type SendStatus int

const (
	// Sent: the transport acknowledged the request (or, HTTP, the
	// downstream answered 2xx).
	Sent SendStatus = iota
	// NotSent: the request surely never left, for a reason of hipq's own
	// (no call slot in time): the claim is undone.
	NotSent
	// Refused: the neighbour refused the request, so it never left (a
	// broker's refusal, a refused connection): the claim is undone and
	// the neighbour backs off; once its refusals have lasted longer than
	// the route's Timeout, the attempt ends as a dispatch error instead.
	Refused
	// Unknown: the request may have left (timeout, connection lost,
	// producer closed with the record in flight). at_least_once types undo
	// the claim and send again; at_most_once types end final / failed.
	Unknown
	// Failed: the request itself is at fault or the downstream failed it; a
	// dispatch_error attempt for the retry policy.
	Failed
)

var statusLabels = [...]string{Sent: "sent", NotSent: "not_sent", Refused: "refused", Unknown: "unknown", Failed: "failed"}

// Result is the outcome of one send.
type Result struct {
	Status SendStatus
	Err    error
	// Final, with Failed: the attempt is not retried whatever the policy
	// says (a 4xx, a record too large, or a send of an at_most_once type
	// that may have arrived).
	Final bool
	// Answered, with Failed: the request reached the service (an HTTP
	// answer of any status), so the attempt records sent_at.
	Answered bool
	// Unwritten, with Failed: the request surely never left (a record the
	// broker refused to write): it gives its rate units back.
	Unwritten bool
	// Reply, with Sent: the reply came with the send (HTTP sync mode).
	Reply *correlator.Reply
	// RetryAfter, with Failed: the downstream's Retry-After (429, 503):
	// a retry waits for it instead of the policy's backoff.
	RetryAfter correlator.RetryAfter
}

// QueueConfig is one queue the dispatcher serves.
type QueueConfig struct {
	Name     string
	Order    correlator.Order
	Throttle correlator.Throttle
}

// Config configures a dispatcher.
type Config struct {
	Instance  string
	Interval  time.Duration // poll interval; defaults to DefaultInterval
	BatchSize int           // defaults to DefaultBatchSize
	// MaxInFlight bounds the claimed jobs whose sends are not yet
	// recorded; defaults to DefaultInFlightBatches × BatchSize. Sends are recorded as they
	// finish, so a slow downstream holds its own jobs, not the next claim.
	MaxInFlight int
	Queues      []QueueConfig
	Types       correlator.Types
	// Senders by job type.
	Senders map[string]Sender
	// Metrics receives the dispatcher's counts; nil = not served.
	Metrics *metrics.Metrics
	// DeadLetters copies the replies it dead-letters (a sync reply, an
	// early reply past its TTL) to responses.dead_letter_topic.
	DeadLetters *deadletter.Copier
	// Tracer, when set, traces each send as a child of its job's intake
	// context (TraceLink: linked to it instead); nil: no tracing work.
	Tracer    trace.Tracer
	TraceLink bool
	// IntakeClaimsFor bounds how long after its batch's transaction began
	// a job claimed at intake may still be sent (Reservation.Deliver): it
	// must be well within the rescue's send bound plus grace, so a caller
	// whose sweepers' dispatch.grace is under 20 s passes grace/2 (as
	// cmd/hipq does). 0: DefaultIntakeClaimsFor.
	IntakeClaimsFor time.Duration
}

// Defaults of Config.
const (
	DefaultInterval        = time.Second
	DefaultBatchSize       = 500
	DefaultInFlightBatches = 4
	DefaultIntakeClaimsFor = 10 * time.Second
)

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.Interval = cmp.Or(c.Interval, DefaultInterval)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.MaxInFlight = cmp.Or(c.MaxInFlight, DefaultInFlightBatches*c.BatchSize)
	c.IntakeClaimsFor = cmp.Or(c.IntakeClaimsFor, DefaultIntakeClaimsFor)
	return c
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
	errs     []error            // of deliveries, for the next RunOnce to return
	outages  map[string]*outage // by neighbour: those refusing now
	byType   map[string]int     // claimed jobs whose sends are not recorded yet, by type
	m        *metrics.Metrics
	// rateWake is the pending wake-up for the earliest full rate window
	// to free, and when it fires (local monotonic clock).
	rateWake   *time.Timer
	rateWakeAt time.Time
	// stopping: Run is draining; no more room is reserved for the intake.
	stopping bool
	// backlog: queues whose last round claimed a full batch (more may be
	// due): the intake reserves no room in them, the backlog comes first.
	backlog map[string]bool
}

// outage is a neighbour refusing sends (or whose sends could not start).
type outage struct {
	since    time.Time // the first refusal of this outage (monotonic); zero: none yet
	failures int       // probes refused in a row
	until    time.Time // no claims for it before then
}

// New builds a dispatcher; Run starts it.
func New(log *zap.Logger, st *store.Store, cfg Config) *Dispatcher {
	cfg = cfg.WithDefaults()
	tw := map[string][]correlator.TimeWindow{}
	for name, jt := range cfg.Types {
		if len(jt.Windows) > 0 {
			tw[name] = jt.Windows
		}
	}
	return &Dispatcher{log: log.Named("dispatcher"), st: st, cfg: cfg, wake: make(chan struct{}, 1), typeWindows: tw,
		outages: map[string]*outage{}, byType: map[string]int{}, backlog: map[string]bool{}, m: metrics.Or(cfg.Metrics)}
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
			d.mu.Lock()
			d.stopping = true // (a reservation made before is delivered or released: sends waits for it)
			d.mu.Unlock()
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

// wakeAt wakes the dispatcher at t (just after), unless a wake-up is
// already due sooner: a full rate window is claimed from again the moment
// it frees, not at the next poll.
func (d *Dispatcher) wakeAt(t time.Time) {
	t = t.Add(5 * time.Millisecond)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.rateWake != nil && d.rateWakeAt.After(time.Now()) && !d.rateWakeAt.After(t) {
		return
	}
	if d.rateWake != nil {
		d.rateWake.Stop()
	}
	d.rateWakeAt = t
	d.rateWake = time.AfterFunc(time.Until(t), d.Wake)
}

// listen turns the store's notices of due work into wake-ups. They are
// only hints: polling stays the fallback.
func (d *Dispatcher) listen(ctx context.Context) {
	d.st.WaitJobReady(ctx, d.Wake, func(err error) {
		d.log.Debug("listen for new jobs failed; polling meanwhile", zap.Error(err))
	})
}

// RunOnce claims and sends until no queue has due work left (or every
// neighbour with due work is backing off), and waits until every send is
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
// flight) and starts its deliveries, one per neighbour (topic, host). It returns how many
// jobs it claimed or rescheduled, and whether the batch was full (more may
// be due).
//
// Once the claim has committed, nothing may keep its jobs from their
// deliveries: they start first, and the rescheduling of jobs found outside
// their windows comes after (its failure only leaves those jobs waiting for
// the next round).
func (d *Dispatcher) round(ctx context.Context, q QueueConfig) (int, bool, error) {
	open, capped := d.sendable(q)
	// The types a claim could take now: none without room in flight (a
	// delivery finishing wakes the dispatcher), a capped one only with
	// room of its own.
	var types []string
	if d.inflight.Load() < int64(d.cfg.MaxInFlight) {
		types = append(types, open...)
		for name, room := range capped {
			if room > 0 {
				types = append(types, name)
			}
		}
	}
	if len(types) == 0 {
		return 0, false, nil
	}
	// In a queue without limits whose last round did not claim a full
	// batch, most wake-ups (a batch stored and claimed by the intake, a
	// delivery recorded, a job ended) find nothing due. A probe says so for
	// a tenth of a claim's cost, and is wider than the claim (the same
	// due jobs, whatever their windows), so it never keeps a due job from
	// its claim. (In a queue with limits a claim often finds nothing while
	// jobs are due, waiting for a slot: a probe would only add to it.) A
	// failed probe leaves the answer to the claim.
	d.mu.Lock()
	full := d.backlog[q.Name]
	d.mu.Unlock()
	if !full && !q.Throttle.Bounded() {
		due, err := d.st.JobsDue(ctx, q.Name, types)
		if err != nil {
			d.log.Debug("probe for due jobs failed; claiming", zap.String("queue", q.Name), zap.Error(err))
		} else if !due {
			add(d.m.ClaimRounds.WithLabelValues(q.Name, "nothing_due"), 1)
			return 0, false, nil
		}
	}
	total, more, ran := 0, false, false
	var errs []error
	claim := func(types []string, limit int) {
		if len(types) == 0 {
			return
		}
		// The room is taken before the claim (the intake takes it too:
		// Reserve), and what the claim did not use given back after its
		// deliveries started, which count their own jobs.
		limit = d.take(min(limit, d.cfg.BatchSize))
		if limit <= 0 {
			return // a delivery finishing wakes the dispatcher
		}
		n, full, err := d.claim(ctx, q, types, limit)
		d.inflight.Add(-int64(limit))
		total, more, ran = total+n, more || full, true
		if err != nil {
			errs = append(errs, err)
		}
	}
	claim(open, d.cfg.BatchSize)
	// A type with a MaxInFlight is claimed on its own, never more than its
	// room: a slow downstream's jobs never wait for slots in numbers.
	for _, name := range slices.Sorted(maps.Keys(capped)) {
		claim([]string{name}, capped[name])
	}
	if ran { // (no room, no claim: whether work is left is not known)
		d.mu.Lock()
		d.backlog[q.Name] = more
		d.mu.Unlock()
	}
	return total, more, errors.Join(errs...)
}

// claim claims up to limit due jobs of the given types and starts their
// deliveries.
func (d *Dispatcher) claim(ctx context.Context, q QueueConfig, types []string, limit int) (int, bool, error) {
	claim, err := d.st.JobClaim(ctx, store.JobClaimParams{Queue: q.Name, Order: q.Order, Limit: limit,
		Instance: d.cfg.Instance, Types: types, Throttle: q.Throttle, TypeWindows: d.typeWindows})
	if err != nil {
		return 0, false, err
	}
	if !claim.RateFreeAt.IsZero() {
		d.wakeAt(time.Now().Add(claim.RateFreeAt.Sub(claim.Now())))
	}
	n := len(claim.Jobs) + len(claim.Closed)
	more := n == limit
	result := "empty"
	if n > 0 {
		result = "claimed"
	}
	add(d.m.ClaimRounds.WithLabelValues(q.Name, result), 1)
	if len(claim.Jobs) > 0 {
		add(d.m.Claimed.WithLabelValues(q.Name), len(claim.Jobs))
		d.dispatch(ctx, q, claim.Jobs)
	}
	return n, more, d.deferClosed(ctx, q, &claim)
}

// dispatch starts the deliveries of claimed jobs, one per neighbour: a
// slow host's calls never hold back the record of another's.
func (d *Dispatcher) dispatch(ctx context.Context, q QueueConfig, claimed []store.Claimed) {
	type to struct {
		s Sender
		n string
	}
	by := map[to][]store.Claimed{}
	for _, c := range claimed {
		if c.WindowsErr != nil {
			d.log.Warn("job's time windows unreadable here; taken as open, as the claim takes them", zap.Int64("job_id", c.ID),
				zap.String("job_type", c.JobType), zap.Error(c.WindowsErr))
		}
		s := d.cfg.Senders[c.JobType] // nil: not sendable here after all; its claim is undone
		k := to{s, d.route(s, c.JobType).Neighbour}
		if by[k] == nil {
			by[k] = make([]store.Claimed, 0, len(claimed)) // most rounds have one neighbour
		}
		by[k] = append(by[k], c)
	}
	for k, jobs := range by {
		d.start(ctx, q, k.s, jobs)
	}
}

// take takes up to n jobs of room in flight, never past MaxInFlight, and
// returns how many it took.
func (d *Dispatcher) take(n int) int {
	for {
		used := d.inflight.Load()
		k := min(int64(n), int64(d.cfg.MaxInFlight)-used)
		if k <= 0 {
			return 0
		}
		if d.inflight.CompareAndSwap(used, used+k) {
			return int(k)
		}
	}
}

// Reservation is room in flight the intake holds for jobs it may claim as
// it stores them (store.IntakeJob.Claim). It must end in Deliver or
// Release.
type Reservation struct {
	d     *Dispatcher
	n     int             // jobs of room held
	types map[string]bool // the queue's types that may be claimed now
	queue QueueConfig
}

// Reserve holds room in flight for new jobs of queue (jobTypes: one entry
// per job), to be claimed as the intake stores them and sent by this
// dispatcher: so a fresh due job is written once (running) instead of
// inserted and then claimed. Only a queue without limits (throttle,
// per-type caps, rates) qualifies, and only types this instance sends,
// whose neighbour is not backing off, without time windows or a cap of
// their own in flight: everything else is claimed as usual. It holds room
// for the jobs of those types only, at most a batch (BatchSize), and none
// while the queue has a backlog (the dispatcher's last round claimed a
// full batch: those jobs come first, and need the room). It returns nil
// when there is no room, the queue is not served here, or the dispatcher
// is stopping.
func (d *Dispatcher) Reserve(queue string, jobTypes []string) *Reservation {
	i := slices.IndexFunc(d.cfg.Queues, func(q QueueConfig) bool { return q.Name == queue })
	if i < 0 || len(jobTypes) == 0 {
		return nil
	}
	q := d.cfg.Queues[i]
	if q.Throttle.Bounded() {
		return nil
	}
	open, _ := d.sendable(q)
	types := map[string]bool{}
	for _, name := range open {
		if len(d.typeWindows[name]) == 0 {
			types[name] = true
		}
	}
	n := 0
	for _, t := range jobTypes {
		if types[t] {
			n++
		}
	}
	if n == 0 {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stopping || d.backlog[queue] {
		return nil
	}
	k := d.take(min(n, d.cfg.BatchSize))
	if k <= 0 {
		return nil
	}
	d.sends.Add(1) // Run's drain waits for what the reservation becomes
	return &Reservation{d: d, n: k, types: types, queue: q}
}

// Order is the order of the reservation's queue: the intake claims the
// jobs of a batch in it when they outnumber the room.
func (r *Reservation) Order() correlator.Order { return r.queue.Order }

// Room is how many jobs the reservation holds room for.
func (r *Reservation) Room() int { return r.n }

// Takes says whether a job of this type may be claimed under it.
func (r *Reservation) Takes(jobType string) bool { return r.types[jobType] }

// Deliver starts the deliveries of the jobs claimed under the reservation
// (its batch committed), one per neighbour, and gives back the room they
// did not use.
//
// A claim made longer ago than Config.IntakeClaimsFor (its batch's
// transaction was that slow) is undone instead, never sent: the longer a
// claim waits, the nearer the rescue of unsent claims, which may take it
// back while its request is going out. The undo is a delivery record,
// tried again while PostgreSQL's failure may pass, and Run's drain waits
// for it.
func (r *Reservation) Deliver(ctx context.Context, jobs []store.Claimed) {
	d := r.d
	ctx = context.WithoutCancel(ctx)
	var stale []store.AttemptRef
	fresh := make([]store.Claimed, 0, len(jobs))
	for i := range jobs {
		if time.Since(jobs[i].ClaimedLocal) > d.cfg.IntakeClaimsFor {
			stale = append(stale, jobs[i].Ref())
			// Counted as sends that could not start, as the transports' undone ones.
			add(d.m.Dispatches.WithLabelValues(r.queue.Name, transportName(d.cfg.Senders[jobs[i].JobType]), statusLabels[NotSent]), 1)
		} else {
			fresh = append(fresh, jobs[i])
		}
	}
	if len(stale) > 0 {
		d.sends.Add(1) // (the reservation's count holds Run's drain open until then)
		go func() {
			defer d.sends.Done()
			res, err := d.record(ctx, store.Delivery{Undo: stale})
			if err != nil {
				d.log.Error("jobs claimed at intake too long ago could not be undone; the rescue of unsent claims will take them",
					zap.String("queue", r.queue.Name), zap.Int("jobs", len(stale)), zap.Error(err))
				return
			}
			d.log.Warn("jobs claimed at intake undone, not sent: their batch took too long to store", zap.String("queue", r.queue.Name),
				zap.Int("jobs", len(stale)), zap.Int("undone", res.Undone), zap.Duration("bound", d.cfg.IntakeClaimsFor))
			d.Wake() // they wait to be claimed now
		}()
	}
	if len(fresh) > 0 {
		add(d.m.Claimed.WithLabelValues(r.queue.Name), len(fresh))
		d.dispatch(ctx, r.queue, fresh)
	}
	r.Release()
}

// Release gives the reservation's room back (its batch failed, or claimed
// nothing); after Deliver it does nothing.
func (r *Reservation) Release() {
	if r.n < 0 {
		return
	}
	r.d.inflight.Add(-int64(r.n))
	r.n = -1
	r.d.sends.Done()
	r.d.Wake()
}

// start runs one delivery in its own goroutine, counting its jobs in flight
// until their record lands.
func (d *Dispatcher) start(ctx context.Context, q QueueConfig, s Sender, jobs []store.Claimed) {
	d.inflight.Add(int64(len(jobs)))
	d.mu.Lock()
	for _, c := range jobs {
		d.byType[c.JobType]++
	}
	d.mu.Unlock()
	d.sends.Add(1)
	go func() {
		defer d.sends.Done()
		err := d.deliver(ctx, q, s, jobs)
		d.inflight.Add(-int64(len(jobs)))
		d.mu.Lock()
		for _, c := range jobs {
			d.byType[c.JobType]--
		}
		if err != nil {
			d.errs = append(d.errs, err)
		}
		d.mu.Unlock()
		d.Wake()
	}()
}

// deliver sends one neighbour's share of a claim and records what became
// of each send in one transaction (store.DeliveryRecord): sent_at, undone
// claims, dispatch errors through the retry policy, replies that came with
// the send, and early replies waiting for these jobs.
func (d *Dispatcher) deliver(ctx context.Context, q QueueConfig, s Sender, jobs []store.Claimed) error {
	var results []Result
	endSpans := d.startSends(ctx, s, jobs)
	if s != nil {
		results = s.Send(ctx, jobs)
	} else {
		results = make([]Result, len(jobs))
		for i := range results {
			results[i] = Result{Status: NotSent, Err: errors.New("no transport for this job type here")}
		}
	}
	var (
		rec      store.Delivery
		byStatus [Failed + 1]int
		undone   = map[string]int{} // by neighbour
		resent   = map[string]int{} // by neighbour: sends in doubt, to be sent again
		reached  = map[string]bool{}
		refused  = map[string]error{} // by neighbour: one of its refusals
		notSent  = map[string]error{}
	)
	for i, r := range results {
		switch r.Status {
		case Refused:
			refused[d.route(s, jobs[i].JobType).Neighbour] = r.Err
		case NotSent:
			notSent[d.route(s, jobs[i].JobType).Neighbour] = r.Err
		}
	}
	ages := d.refusedBy(refused, true) // how long each refusing neighbour has refused
	d.refusedBy(notSent, false)        // sends that could not start back off too, never to spin
	for i, r := range results {
		c := &jobs[i]
		ref := c.Ref()
		jt := d.cfg.Types[c.JobType]
		route := d.route(s, c.JobType)
		byStatus[r.Status]++
		switch r.Status {
		case Sent:
			reached[route.Neighbour] = true
			rec.Sent = append(rec.Sent, ref)
			if r.Reply != nil {
				rec.Replies = append(rec.Replies, store.ReplyIn{Reply: r.Reply, Kind: store.SourceCallback, Queue: c.Queue,
					Source: store.Source{Value: r.Reply.Result}})
			}
		case NotSent:
			rec.Undo = append(rec.Undo, ref)
			undone[route.Neighbour]++
		case Refused:
			if age := ages[route.Neighbour]; route.Timeout > 0 && age >= route.Timeout {
				err := fmt.Errorf("%s has refused every send for %s, longer than the send timeout (%s): %w",
					route.Neighbour, age.Round(time.Second), route.Timeout, r.Err)
				r := dispatchError(c, jt, Result{Err: err}, true, false)
				r.NeverLeft = true // every send was refused: none left
				rec.Resolves = append(rec.Resolves, r)
			} else {
				rec.Undo = append(rec.Undo, ref)
				undone[route.Neighbour]++
			}
		case Unknown:
			if resend, res := correlator.SendUnknown(jt, errText(r.Err)); !resend {
				rec.Resolves = append(rec.Resolves, store.Resolve{Queue: c.Queue, JobID: c.ID, Attempt: c.Attempt, Claim: c.StartedAt, Res: res})
			} else {
				rec.Resend = append(rec.Resend, ref) // it may have left: its rate units keep counting
				resent[route.Neighbour]++
			}
		case Failed:
			if r.Answered {
				reached[route.Neighbour] = true
			}
			res := dispatchError(c, jt, r, !r.Final, r.Answered)
			res.NeverLeft = r.Unwritten && !r.Answered
			rec.Resolves = append(rec.Resolves, res)
		}
	}
	for n := range reached {
		_, r := refused[n]
		_, ns := notSent[n]
		if !r && !ns {
			d.recovered(n)
		}
	}
	for st, n := range byStatus {
		add(d.m.Dispatches.WithLabelValues(q.Name, transportName(s), statusLabels[st]), n)
	}
	if endSpans != nil {
		endSpans(results)
	}
	res, err := d.record(ctx, rec)
	if err != nil {
		return err
	}
	for n, k := range undone {
		d.log.Warn("claims undone: their requests never left", zap.String("queue", q.Name), zap.String("to", n),
			zap.Int("jobs", k))
	}
	for n, k := range resent {
		d.log.Warn("claims undone to be sent again: their sends ended in doubt, and they count in their rate windows",
			zap.String("queue", q.Name), zap.String("to", n), zap.Int("jobs", k))
	}
	if len(rec.Replies) > 0 {
		d.m.ObserveReplies(metrics.SourceSync, res.Replies.Counts(), res.Replies.RoundTrips())
		d.traceSyncReplies(ctx, jobs, res.Replies)
	}
	d.m.ObserveReplies(metrics.SourceEarly, res.Early.Counts(), res.Early.RoundTrips())
	d.cfg.DeadLetters.Copy(append(res.Replies.DeadLetters, res.Early.DeadLetters...))
	if n := len(res.Early.Applied); n > 0 {
		d.log.Info("early replies applied", zap.Int("replies", n))
	}
	return nil
}

func transportName(s Sender) string {
	if s == nil {
		return "none"
	}
	return s.Transport()
}

func (d *Dispatcher) route(s Sender, jobType string) Route {
	if s == nil {
		return Route{Neighbour: "none"}
	}
	return s.Route(jobType)
}

// record writes a delivery's record, trying again with backoff while
// PostgreSQL fails for a reason that may pass (IsTransient), until it lands
// or ctx ends: a delivered request must never look unsent to the sweeper,
// nor a reply be lost, because PostgreSQL blinked. A record PostgreSQL
// refuses for good is recorded job by job; a job whose own record is
// refused again is recorded without what PostgreSQL refused (a reply, a
// text), and if even that is refused it is left to the sweeper.
func (d *Dispatcher) record(ctx context.Context, rec store.Delivery) (store.DeliveryResult, error) {
	res, err := d.retry(ctx, rec)
	if err == nil || ctx.Err() != nil {
		return res, err
	}
	d.log.Error("PostgreSQL refused a delivery record; recording its jobs one by one", zap.Error(err))
	var out store.DeliveryResult
	var errs []error
	for _, one := range splitDelivery(rec) {
		r, err := d.retry(ctx, one)
		if err != nil && ctx.Err() == nil {
			r, err = d.retry(ctx, d.stripped(one, err))
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("record the send of job %v: %w", one.Jobs(), err))
			continue
		}
		out.Undone += r.Undone
		out.Replies.Merge(r.Replies)
		out.Early.Merge(r.Early)
	}
	return out, errors.Join(errs...)
}

// retry writes one record, again with backoff while PostgreSQL's failure
// may pass; it returns the first failure that will not.
func (d *Dispatcher) retry(ctx context.Context, rec store.Delivery) (store.DeliveryResult, error) {
	for try := 0; ; try++ {
		res, err := d.st.DeliveryRecord(ctx, rec, d.cfg.Types)
		switch {
		case err == nil:
			if try > 0 {
				d.log.Info("sends recorded after PostgreSQL failures", zap.Int("tries", try+1))
			}
			return res, nil
		case ctx.Err() != nil || !store.IsTransient(err):
			return res, fmt.Errorf("record sends: %w", err)
		}
		wait := backoff(try)
		d.log.Warn("cannot record sends; trying again", zap.Int("jobs", len(rec.Jobs())), zap.Int("try", try+1),
			zap.Duration("in", wait), zap.Error(err))
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// splitDelivery cuts a delivery into one per job.
func splitDelivery(rec store.Delivery) []store.Delivery {
	var out []store.Delivery
	replies := map[int64]store.ReplyIn{}
	for _, r := range rec.Replies {
		if r.Reply.JobID != nil {
			replies[*r.Reply.JobID] = r
		}
	}
	for _, r := range rec.Sent {
		one := store.Delivery{Sent: []store.AttemptRef{r}}
		if in, ok := replies[r.JobID]; ok {
			one.Replies = []store.ReplyIn{in}
		}
		out = append(out, one)
	}
	for _, r := range rec.Undo {
		out = append(out, store.Delivery{Undo: []store.AttemptRef{r}})
	}
	for _, r := range rec.Resend {
		out = append(out, store.Delivery{Resend: []store.AttemptRef{r}})
	}
	for _, r := range rec.Resolves {
		out = append(out, store.Delivery{Resolves: []store.Resolve{r}})
	}
	return out
}

// stripped is one job's delivery without anything PostgreSQL could refuse:
// a reply it refused ends the attempt failed, saying why.
func (d *Dispatcher) stripped(one store.Delivery, cause error) store.Delivery {
	unstorable := correlator.ReplyUnstorable(cause.Error())
	out := store.Delivery{Sent: one.Sent, Undo: one.Undo, Resend: one.Resend}
	claims := map[int64]time.Time{} // the claims sent: a sync reply answers one
	for _, r := range one.Sent {
		claims[r.JobID] = r.Claim
	}
	for _, r := range one.Replies {
		if r.Reply.JobID == nil || r.Reply.Attempt == nil {
			continue
		}
		out.Resolves = append(out.Resolves, store.Resolve{Queue: r.Queue, JobID: *r.Reply.JobID, Attempt: *r.Reply.Attempt,
			Claim: claims[*r.Reply.JobID], Sent: true, Res: unstorable})
	}
	for _, r := range one.Resolves {
		r.Reply, r.Result = nil, nil
		r.Res.AttemptError += " (" + unstorable.AttemptError + ")"
		out.Resolves = append(out.Resolves, r)
	}
	return out
}

// dispatchError resolves a failed send through the retry policy (not
// retried at all unless retryable); reached says the request arrived.
func dispatchError(c *store.Claimed, jt *correlator.JobType, r Result, retryable, reached bool) store.Resolve {
	return store.Resolve{Queue: c.Queue, JobID: c.ID, Attempt: c.Attempt, Claim: c.StartedAt, Sent: reached,
		Res: correlator.DispatchFailed(jt, c.Running(), errText(r.Err), retryable, r.RetryAfter, c.DBNow())}
}

func errText(err error) string {
	if err == nil {
		return "dispatch_error"
	}
	return err.Error()
}

// refusedBy records a delivery's refusals: each neighbour that refused
// backs off, longer each time in a row, and its outage's age is returned.
// A send that could not start (outage false: no call slot in time, no
// route; starts false) backs off the same way but starts no outage clock: it never turns
// a later refusal into a dispatch error sooner.
func (d *Dispatcher) refusedBy(refused map[string]error, starts bool) map[string]time.Duration {
	if len(refused) == 0 {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	ages := map[string]time.Duration{}
	for n, err := range refused {
		o := d.outages[n]
		if o == nil {
			o = &outage{}
			d.outages[n] = o
		}
		if starts && o.since.IsZero() {
			o.since = now
		}
		if !o.since.IsZero() {
			ages[n] = now.Sub(o.since)
		}
		if now.Before(o.until) {
			continue // another delivery of the same probe said so already
		}
		o.failures++
		wait := min(time.Second<<min(o.failures-1, 5), 30*time.Second)
		o.until = now.Add(wait)
		d.log.Warn("sends did not leave; pausing claims for it", zap.String("to", n), zap.Bool("refused", starts),
			zap.Duration("for", wait), zap.Duration("refusing_since", ages[n].Round(time.Millisecond)), zap.Error(err))
	}
	return ages
}

// recovered ends a neighbour's outage once a delivery reached it without
// a refusal.
func (d *Dispatcher) recovered(n string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.outages[n] != nil {
		d.log.Info("sends reach it again; claiming resumes", zap.String("to", n))
		delete(d.outages, n)
	}
}

// sendable lists the queue's job types this instance may claim now: those
// with a transport here (never a type rolling out, or a transport this
// build lacks) whose neighbour is not backing off; capped are those with a
// route MaxInFlight, with the room each has left. So one refusing topic or
// one slow host holds back its own types only.
func (d *Dispatcher) sendable(q QueueConfig) (open []string, capped map[string]int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	capped = map[string]int{}
	for name, jt := range d.cfg.Types {
		s := d.cfg.Senders[name]
		if jt.Queue != q.Name || s == nil {
			continue
		}
		r := s.Route(name)
		if o := d.outages[r.Neighbour]; o != nil && now.Before(o.until) {
			continue
		}
		if r.MaxInFlight > 0 {
			capped[name] = r.MaxInFlight - d.byType[name]
			continue
		}
		open = append(open, name)
	}
	slices.Sort(open)
	return open, capped
}

// deferClosed moves due jobs found outside their time windows to their next
// opening without using an attempt, or ends them final / expired when that
// opening is past their expiry (they are never sent). It reads PostgreSQL's
// clock, the one the claim found them closed by.
func (d *Dispatcher) deferClosed(ctx context.Context, q QueueConfig, claim *store.Claim) error {
	if len(claim.Closed) == 0 {
		return nil
	}
	now := claim.Now()
	ds := make([]store.Deferral, 0, len(claim.Closed))
	expired := 0
	for _, c := range claim.Closed {
		def := correlator.Defer(correlator.WindowsFor(d.cfg.Types.Get(c.JobType), c.TimeWindows), c.ExpiresAt, now)
		if def.Disagree {
			d.log.Warn("time window open here but closed in PostgreSQL; retrying in a minute",
				zap.Int64("job_id", c.ID), zap.String("job_type", c.JobType), zap.NamedError("windows_error", c.WindowsErr))
		}
		if def.Expire {
			expired++
		}
		ds = append(ds, store.Deferral{Queue: c.Queue, ID: c.ID, State: c.State, Attempt: c.Attempt, RunAt: def.RunAt, Expire: def.Expire})
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

func backoff(try int) time.Duration {
	return min(50*time.Millisecond<<min(try, 8), 5*time.Second)
}

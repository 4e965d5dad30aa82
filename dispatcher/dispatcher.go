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
	"sync"
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

	room    room           // claimed jobs whose sends are not recorded yet, within MaxInFlight
	sends   sync.WaitGroup // deliveries running
	mu      sync.Mutex
	errs    []error            // of deliveries, for the next RunOnce to return
	outages map[string]*outage // by neighbour: those refusing now
	byType  map[string]int     // claimed jobs whose sends are not recorded yet, by type
	m       *metrics.Metrics
	// rateWake is the pending wake-up for the earliest full rate window
	// to free, and when it fires (local monotonic clock).
	rateWake   *time.Timer
	rateWakeAt time.Time
	// stopping: Run is draining; no more room is reserved for the intake.
	stopping bool
	// backlog: queues whose last round claimed a full batch (more may be
	// due), or whose limits held due jobs back (store.Claim.Held): the
	// intake reserves no room in them, the backlog comes first.
	backlog map[string]bool
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
		room:    room{max: int64(cfg.MaxInFlight)},
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

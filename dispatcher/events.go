package dispatcher

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// HeaderResultOmitted marks an event sent without its result, which made
// it larger than the broker takes.
const HeaderResultOmitted = "hipq-result-omitted"

// Defaults of RelayConfig.
const (
	// DefaultRelayMaxBackoff bounds how long a refusing topic waits
	// between tries.
	DefaultRelayMaxBackoff = 30 * time.Second
	// relayDeleteTimeout bounds the delete of events sent, which runs
	// even when the relay is stopping (else they are sent again).
	relayDeleteTimeout = 10 * time.Second
)

// RelayConfig configures the events relay.
type RelayConfig struct {
	// Interval between looks for events when no notice wakes the relay,
	// and between its checks that it still holds the relay's lock.
	// Defaults to DefaultInterval.
	Interval time.Duration
	// BatchSize is the most events of a topic read and produced at once.
	// Defaults to DefaultBatchSize.
	BatchSize int
	// MaxBackoff bounds the wait of a refusing topic. Defaults to
	// DefaultRelayMaxBackoff.
	MaxBackoff time.Duration
	// MaxDrains bounds the topics relayed at once (each holds a
	// connection of the pool while it reads or deletes): with many
	// reply_to topics waiting, the others wait their turn. Defaults to
	// DefaultMaxDrains.
	MaxDrains int
	Metrics   *metrics.Metrics
	// Topics are the configured events topics: their pending count is
	// reported (0 included) whether or not events wait.
	Topics []string
	// CrashPoint is a test hook: "events:after-produce" kills the process
	// once a batch was acknowledged, before its rows are deleted.
	CrashPoint string
}

// listEvery is how often at most the relay looks at every topic for
// events pending, besides those notices name: every interval, but not
// more often than once a second.
func listEvery(interval time.Duration) time.Duration { return max(interval, time.Second) }

// pendingCountEvery is how often at most the relay counts the pending
// events of each topic (hipq_events_pending).
const pendingCountEvery = time.Second

// DefaultMaxDrains is RelayConfig.MaxDrains's default.
const DefaultMaxDrains = 4

// WithDefaults fills what is left out.
func (c RelayConfig) WithDefaults() RelayConfig {
	c.Interval = cmp.Or(c.Interval, DefaultInterval)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.MaxBackoff = cmp.Or(c.MaxBackoff, DefaultRelayMaxBackoff)
	c.MaxDrains = cmp.Or(c.MaxDrains, DefaultMaxDrains)
	c.Metrics = metrics.Or(c.Metrics)
	return c
}

// Relay produces the outcome events committed to hipq_event to Kafka and
// deletes each once the broker acknowledged it: at least once, with the
// event's id (hipq-event-id) the same every time it is sent.
//
// One instance relays at a time: the one holding the relay's PostgreSQL
// lock (store.EventRelayLock); the others wait to take it over. The leader
// drains each topic with events pending in a goroutine of its own, so a
// topic that refuses holds back its own events only, and backs off
// (longer each time in a row) before it tries that topic again.
//
// Order. The events of one job key are numbered in the order they were
// committed (store.eventsCTE), and rows are deleted once sent, never
// passed by a mark: an event committed after one of a higher id is read at
// the next look, never skipped. A batch takes each key's first pending
// event only, so a key's later event can never be acknowledged while an
// earlier one failed; with one key on one partition and an idempotent
// producer, a key's events reach the topic in commit order. An event is
// sent again (never lost) when the relay dies between produce and delete,
// or loses its lock while a produce is in flight (then the new leader may
// send an event again after that key's next one: consumers keep the ids
// they have seen).
type Relay struct {
	log *zap.Logger
	st  *store.Store
	cl  *kgo.Client
	cfg RelayConfig

	wake chan struct{}

	mu      sync.Mutex
	outages map[string]*outage            // by topic
	pending map[string]bool               // topics whose pending count is reported
	cursors map[string]*store.EventCursor // by topic: where its next read starts
	named   map[string]bool               // topics notices named, not drained since
	lookAll bool                          // a notice asked to look at every topic

	peakDrains atomic.Int64 // the most topics drained at once (tests)
}

// NewRelay builds the relay of st's events over cl, an idempotent
// producer (KafkaProducerOpts).
func NewRelay(log *zap.Logger, st *store.Store, cl *kgo.Client, cfg RelayConfig) *Relay {
	return &Relay{log: log.Named("events"), st: st, cl: cl, cfg: cfg.WithDefaults(), wake: make(chan struct{}, 1),
		outages: map[string]*outage{}, pending: map[string]bool{}, cursors: map[string]*store.EventCursor{}, named: map[string]bool{}}
}

// Client is the producer the relay writes with.
func (r *Relay) Client() *kgo.Client { return r.cl }

// poke wakes the relay to drain topics, or to look at every topic when
// topics is nil.
func (r *Relay) poke(topics []string) {
	r.mu.Lock()
	if topics == nil {
		r.lookAll = true
	}
	for _, t := range topics {
		r.named[t] = true
	}
	r.mu.Unlock()
	r.nudge()
}

// nudge wakes the relay to look at the topics named so far.
func (r *Relay) nudge() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// takeNamed returns the topics named since the last call, in name order,
// and whether every topic should be looked at.
func (r *Relay) takeNamed() ([]string, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	named, all := slices.Sorted(maps.Keys(r.named)), r.lookAll
	clear(r.named)
	r.lookAll = false
	return named, all
}

// Run relays events while ctx lasts: as the leader when it holds the
// relay's lock, else trying to take it every Interval.
func (r *Relay) Run(ctx context.Context) error {
	listening := make(chan struct{})
	go func() {
		defer close(listening)
		r.st.WaitEvents(ctx, r.poke, func(err error) { r.log.Warn("listening for events failed; polling meanwhile", zap.Error(err)) })
	}()
	defer func() { <-listening }()
	for {
		lease, ok, err := r.st.EventRelayLock(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			r.log.Warn("could not try the relay's lock", zap.Error(err))
		case ok:
			r.log.Info("relaying outcome events")
			// Each lead starts from the cursors kept in PostgreSQL: while
			// another instance led, it relayed events this one's cursors
			// would read again (those left on jobs are not deleted).
			r.mu.Lock()
			clear(r.cursors)
			r.mu.Unlock()
			r.lead(ctx, lease)
			lease.Release()
			r.forgetPending()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(r.cfg.Interval):
		}
	}
}

// lead relays while the lease holds and ctx lasts.
func (r *Relay) lead(ctx context.Context, lease *store.Lease) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	var mu sync.Mutex
	draining := map[string]bool{}
	turn := 0
	tick := time.NewTicker(r.cfg.Interval)
	defer tick.Stop()
	var counted, listed time.Time
	for {
		// The topics to drain: those notices named, and every topic with
		// events pending when a notice asked for it (as the listener
		// starts), or once a second at most (a notice lost with its
		// connection): a look at every topic reads hipq_event_topic from
		// its first entry, the rows deleted since the last vacuum too.
		topics, all := r.takeNamed()
		if all || time.Since(listed) >= listEvery(r.cfg.Interval) {
			pending, err := r.st.EventTopics(ctx)
			if err != nil && ctx.Err() == nil {
				r.log.Warn("could not list the topics with events", zap.Error(err))
			}
			if err == nil {
				listed = time.Now()
				mu.Lock()
				r.forgetCursors(pending, draining)
				mu.Unlock()
				topics = slices.Compact(slices.Sorted(slices.Values(append(topics, pending...))))
			}
		}
		// (Each look starts one topic further, so that with more topics
		// waiting than drains at once none waits behind the others for long.)
		turn++
		var later []string // (busy, or no drain free: drained once one ends, which nudges the relay)
		for k := range topics {
			t := topics[(k+turn)%len(topics)]
			mu.Lock()
			busy, full := draining[t], len(draining) >= r.cfg.MaxDrains
			mu.Unlock()
			if busy || full {
				later = append(later, t)
				continue
			}
			if r.backingOff(t) {
				continue // (its backoff names it again once it ends)
			}
			mu.Lock()
			draining[t] = true
			if n := int64(len(draining)); n > r.peakDrains.Load() {
				r.peakDrains.Store(n)
			}
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.drain(ctx, t)
				mu.Lock()
				delete(draining, t)
				mu.Unlock()
				r.nudge() // (for the topics waiting for a drain, or named while this one ran)
			}()
		}
		if len(later) > 0 {
			r.mu.Lock()
			for _, t := range later {
				r.named[t] = true
			}
			r.mu.Unlock()
		}
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		case <-tick.C:
			if err := lease.Alive(ctx); err != nil {
				if ctx.Err() == nil {
					r.log.Warn("lost the relay's lock; another instance may relay now", zap.Error(err))
				}
				return
			}
			// (A count reads the whole table: once a second at most,
			// however short the interval.)
			if time.Since(counted) >= pendingCountEvery {
				r.countPending(ctx)
				counted = time.Now()
			}
		}
	}
}

// drain relays topic's events until none is left or the topic refuses.
func (r *Relay) drain(ctx context.Context, topic string) {
	for ctx.Err() == nil {
		n, more, err := r.RelayTopic(ctx, topic)
		if err != nil {
			if ctx.Err() == nil {
				r.refused(topic, err)
			}
			return
		}
		if n > 0 {
			r.recovered(topic)
		}
		if !more {
			return
		}
	}
}

// RelayTopic produces one batch of topic's pending events, in id order,
// and deletes those the broker acknowledged. It takes each job key's first
// pending event only (see Relay). It returns how many were sent, whether
// more may wait, and why some were not sent (the topic refused them: they
// wait for the next try).
func (r *Relay) RelayTopic(ctx context.Context, topic string) (int, bool, error) {
	cur, err := r.cursor(ctx, topic)
	if err != nil {
		return 0, false, err
	}
	evs, err := r.st.EventReadFrom(ctx, topic, cur, r.cfg.BatchSize)
	if err != nil {
		return 0, false, err
	}
	more := len(evs) == r.cfg.BatchSize
	seen := make(map[string]bool, len(evs))
	batch := make([]store.Event, 0, len(evs)) // (evs stays whole: the cursor moves by what it holds)
	for _, e := range evs {
		if seen[e.JobKey] || cur.Holds(e.JobKey) {
			// (A later event of a key sent in this batch waits for the
			// next; so does every later event of a key whose event was
			// read from its job and sent, until that event is passed by
			// the cursor kept or struck from its job: a relay after a
			// crash would send it again, after them.)
			more = true
			continue
		}
		seen[e.JobKey] = true
		batch = append(batch, e)
	}
	if len(batch) == 0 {
		if len(evs) > 0 { // (every one held back by Holds: the delete strikes what held them)
			return 0, false, r.st.EventDeleteFrom(ctx, cur, nil, evs[0].ID)
		}
		return 0, false, nil
	}
	recs := make([]*kgo.Record, len(batch))
	for i := range batch {
		recs[i] = EventRecord(&batch[i], false)
	}
	results := r.cl.ProduceSync(ctx, recs...)
	sent := make([]store.EventRef, 0, len(batch))
	var tooLarge []int
	var firstErr error
	for i, pr := range results {
		switch {
		case pr.Err == nil:
			sent = append(sent, batch[i].Ref())
		case errors.Is(pr.Err, kerr.MessageTooLarge), errors.Is(pr.Err, kerr.RecordListTooLarge):
			tooLarge = append(tooLarge, i)
		case firstErr == nil:
			firstErr = fmt.Errorf("produce events to %s: %w", topic, pr.Err)
		}
	}
	omitted := 0
	if len(tooLarge) > 0 {
		// Never a topic stalled by an event it can never take: sent
		// without its result, and marked so.
		small := make([]*kgo.Record, len(tooLarge))
		for k, i := range tooLarge {
			small[k] = EventRecord(&batch[i], true)
		}
		for k, pr := range r.cl.ProduceSync(ctx, small...) {
			if pr.Err == nil {
				sent = append(sent, batch[tooLarge[k]].Ref())
				omitted++
			} else if firstErr == nil {
				firstErr = fmt.Errorf("produce events to %s: %w", topic, pr.Err)
			}
		}
	}
	if r.cfg.CrashPoint == "events:after-produce" && len(sent) > 0 {
		// Tests: die with events sent and their rows still pending.
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	done := make(map[int64]bool, len(sent))
	for _, ref := range sent {
		done[ref.ID] = true
	}
	var lowest int64 // (evs are in id order where the cursor is used)
	for _, e := range evs {
		if !done[e.ID] {
			lowest = e.ID
			break
		}
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), relayDeleteTimeout)
	defer cancel()
	if err := r.st.EventDeleteFrom(dctx, cur, sent, lowest); err != nil {
		// Sent, not deleted: they are sent again (consumers drop repeats).
		return len(sent), false, err
	}
	r.cfg.Metrics.Events.WithLabelValues(topic, "sent").Add(float64(len(sent) - omitted))
	if omitted > 0 {
		r.cfg.Metrics.Events.WithLabelValues(topic, "result_omitted").Add(float64(omitted))
		r.log.Warn("events sent without their results: larger than the broker takes", zap.String("topic", topic), zap.Int("events", omitted))
	}
	if refused := len(batch) - len(sent); refused > 0 {
		r.cfg.Metrics.Events.WithLabelValues(topic, "refused").Add(float64(refused))
	}
	return len(sent), more && firstErr == nil, firstErr
}

// cursor is where topic's next read starts: a topic's first read starts
// where the relays before kept it (store.EventCursorOf).
func (r *Relay) cursor(ctx context.Context, topic string) (*store.EventCursor, error) {
	r.mu.Lock()
	c := r.cursors[topic]
	r.mu.Unlock()
	if c != nil {
		return c, nil
	}
	c, err := r.st.EventCursorOf(ctx, topic)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if had := r.cursors[topic]; had != nil {
		return had, nil
	}
	r.cursors[topic] = c
	return c, nil
}

// forgetCursors drops the cursors of the topics with no events pending
// (not in listed), other than the configured ones and those draining: a
// relay that saw many reply_to topics come and go keeps none of theirs.
func (r *Relay) forgetCursors(listed []string, draining map[string]bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for t := range r.cursors {
		if !draining[t] && !slices.Contains(listed, t) && !slices.Contains(r.cfg.Topics, t) {
			delete(r.cursors, t)
		}
	}
}

// EventRecord is the Kafka record of an event (docs/messages.md, "Outcome
// events"); without its result (null, and the header
// HeaderResultOmitted) when omitResult.
func EventRecord(e *store.Event, omitResult bool) *kgo.Record {
	// (The headers' values share one buffer, the key another slice of
	// it: one allocation for what is the relay's work for every event.)
	buf := make([]byte, 0, 2*len(e.JobKey)+len(e.JobType)+len(e.Outcome)+len(e.TraceParent)+48)
	var ends [7]int
	buf = append(buf, e.JobType...)
	ends[0] = len(buf)
	buf = append(buf, e.JobKey...)
	ends[1] = len(buf)
	buf = strconv.AppendInt(buf, e.JobID, 10)
	ends[2] = len(buf)
	buf = strconv.AppendInt(buf, int64(e.Attempt), 10)
	ends[3] = len(buf)
	buf = append(buf, e.Outcome...)
	ends[4] = len(buf)
	buf = strconv.AppendInt(buf, e.ID, 10)
	ends[5] = len(buf)
	buf = append(buf, e.TraceParent...)
	ends[6] = len(buf)
	part := func(i int) []byte {
		from := 0
		if i > 0 {
			from = ends[i-1]
		}
		return buf[from:ends[i]:ends[i]]
	}
	headers := make([]kgo.RecordHeader, 0, 8+len(e.Headers))
	headers = append(headers,
		kgo.RecordHeader{Key: correlator.HeaderJobType, Value: part(0)},
		kgo.RecordHeader{Key: correlator.HeaderJobKey, Value: part(1)},
		kgo.RecordHeader{Key: correlator.HeaderJobID, Value: part(2)},
		kgo.RecordHeader{Key: correlator.HeaderAttempt, Value: part(3)},
		kgo.RecordHeader{Key: correlator.HeaderOutcome, Value: part(4)},
		kgo.RecordHeader{Key: correlator.HeaderEventID, Value: part(5)},
	)
	if e.TraceParent != "" {
		headers = append(headers, kgo.RecordHeader{Key: correlator.HeaderTraceParent, Value: part(6)})
	}
	for _, h := range e.Headers {
		headers = append(headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
	}
	value := []byte(e.Value)
	if omitResult {
		value = withoutResult(e.Value)
		headers = append(headers, kgo.RecordHeader{Key: HeaderResultOmitted, Value: []byte("true")})
	}
	return &kgo.Record{Topic: e.Topic, Key: part(1), Value: value, Headers: headers}
}

// refused backs topic off, longer each time in a row.
func (r *Relay) refused(topic string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	o := r.outages[topic]
	if o == nil {
		o = &outage{since: time.Now()}
		r.outages[topic] = o
	}
	o.failures++
	wait := min(time.Second<<min(o.failures-1, 5), r.cfg.MaxBackoff)
	o.until = time.Now().Add(wait)
	r.log.Warn("a topic refused events; they wait", zap.String("topic", topic), zap.Duration("for", wait),
		zap.Duration("refusing_since", time.Since(o.since).Round(time.Millisecond)), zap.Error(err))
	time.AfterFunc(wait, func() { r.poke([]string{topic}) })
}

func (r *Relay) recovered(topic string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.outages[topic] != nil {
		r.log.Info("a topic takes events again", zap.String("topic", topic))
		delete(r.outages, topic)
	}
}

func (r *Relay) backingOff(topic string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	o := r.outages[topic]
	return o != nil && time.Now().Before(o.until)
}

// countPending reports the events pending by topic.
func (r *Relay) countPending(ctx context.Context) {
	n, err := r.st.EventsPending(ctx)
	if err != nil {
		if ctx.Err() == nil {
			r.log.Warn("could not count pending events", zap.Error(err))
		}
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, t := range r.cfg.Topics {
		r.pending[t] = true
	}
	for t := range r.pending {
		if _, ok := n[t]; !ok {
			r.cfg.Metrics.EventsPending.WithLabelValues(t).Set(0)
		}
	}
	for t, c := range n {
		r.pending[t] = true
		r.cfg.Metrics.EventsPending.WithLabelValues(t).Set(float64(c))
	}
}

// forgetPending stops reporting pending events (another instance may
// relay now, and reports them).
func (r *Relay) forgetPending() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for t := range r.pending {
		r.cfg.Metrics.EventsPending.DeleteLabelValues(t)
	}
	r.pending = map[string]bool{}
}

// withoutResult is an event's value with its result null.
func withoutResult(v json.RawMessage) []byte {
	var m map[string]json.RawMessage
	if json.Unmarshal(v, &m) != nil {
		return v
	}
	m["result"] = json.RawMessage("null")
	b, err := json.Marshal(m)
	if err != nil {
		return v
	}
	return b
}

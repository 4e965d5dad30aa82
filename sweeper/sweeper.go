// Package sweeper is hipq's periodic maintenance: it times out running jobs
// whose reply never came, rescues claims whose request never left, expires
// waiting jobs, re-checks early replies and prunes old rows.
//
// It runs on a cron schedule, normally on one instance at a time (a
// PostgreSQL advisory lock), but correctness never depends on that: every
// step is a guarded, idempotent batch, so two sweepers at once only do the
// same work twice.
package sweeper

import (
	"cmp"
	"context"
	"errors"
	"sync"
	"time"

	"github.com/robfig/cron/v3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
)

// Config configures the sweeper.
type Config struct {
	Schedule            string        // robfig/cron syntax; defaults to DefaultSchedule
	Retention           time.Duration // of final jobs; defaults to DefaultRetention
	DeadLetterRetention time.Duration // defaults to DefaultDeadLetterRetention
	// Grace (dispatch.grace) is how long past its send bound a claim not
	// known to be sent is left before it is taken for lost; defaults to
	// DefaultGrace.
	Grace time.Duration
	// Types are the job types, with their send bounds (SendTimeout).
	Types     correlator.Types
	BatchSize int // rows per statement; defaults to DefaultBatchSize
	// Metrics receives what sweeps did; nil = not served.
	Metrics *metrics.Metrics
	// DeadLetters copies the early replies dead-lettered past their TTL to
	// responses.dead_letter_topic; nil = logged only.
	DeadLetters *deadletter.Copier
	// Tracer, when set, records each timeout as a span in its attempt's
	// trace; nil: no tracing work.
	Tracer trace.Tracer
}

// Defaults of Config.
const (
	DefaultSchedule            = "@every 15s"
	DefaultRetention           = 30 * 24 * time.Hour
	DefaultDeadLetterRetention = 30 * 24 * time.Hour
	DefaultGrace               = time.Minute
	DefaultBatchSize           = 1000
)

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.Schedule = cmp.Or(c.Schedule, DefaultSchedule)
	c.Retention = cmp.Or(c.Retention, DefaultRetention)
	c.DeadLetterRetention = cmp.Or(c.DeadLetterRetention, DefaultDeadLetterRetention)
	c.Grace = cmp.Or(c.Grace, DefaultGrace)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	return c
}

// Sweeper runs the sweeps.
type Sweeper struct {
	log *zap.Logger
	st  *store.Store
	cfg Config

	mu      sync.Mutex        // one rescue at a time
	marks   store.UnsentMarks // how far this sweeper's rescues have looked
	rescues int               // rescues so far
	full    bool              // the last full search has not completed
}

// fullSearchEvery is how many rescues search from the marks before one
// searches every running job again (store.LateClaimMargin): at the
// default schedule, every five minutes.
const fullSearchEvery = 20

// Report counts what one sweep did.
type Report struct {
	TimedOut, Rescued, FailedUnsent, Expired, EarlyApplied, EarlyDeadLettered, Pruned, DeadLettersPruned int
	OperationsPruned                                                                                     int
}

// New builds a sweeper; Run starts it.
func New(log *zap.Logger, st *store.Store, cfg Config) *Sweeper {
	cfg = cfg.WithDefaults()
	cfg.Metrics = metrics.Or(cfg.Metrics)
	return &Sweeper{log: log.Named("sweeper"), st: st, cfg: cfg}
}

// Run sweeps on the schedule until ctx ends.
func (s *Sweeper) Run(ctx context.Context) error {
	c := cron.New()
	_, err := c.AddFunc(s.cfg.Schedule, func() {
		release, ok, err := s.st.SweeperLock(ctx)
		if err != nil {
			s.log.Warn("cannot take the sweeper lock", zap.Error(err))
			return
		}
		if !ok {
			return // another instance is sweeping
		}
		defer release()
		rep, err := s.RunOnce(ctx)
		if err != nil && ctx.Err() == nil {
			s.log.Error("sweep failed", zap.Error(err))
		}
		if rep != (Report{}) {
			s.log.Info("sweep done", zap.Int("timed_out", rep.TimedOut), zap.Int("rescued", rep.Rescued),
				zap.Int("failed_unsent", rep.FailedUnsent), zap.Int("expired", rep.Expired),
				zap.Int("early_applied", rep.EarlyApplied), zap.Int("early_dead_lettered", rep.EarlyDeadLettered),
				zap.Int("pruned", rep.Pruned), zap.Int("dead_letters_pruned", rep.DeadLettersPruned),
				zap.Int("operations_pruned", rep.OperationsPruned))
		}
	})
	if err != nil {
		return err
	}
	c.Start()
	<-ctx.Done()
	<-c.Stop().Done()
	return nil
}

// RunOnce does every step once, each in batches until done.
func (s *Sweeper) RunOnce(ctx context.Context) (Report, error) {
	var rep Report
	var errs []error
	types := s.cfg.Types
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	add(s.drain(ctx, "timed_out", &rep.TimedOut, func() (int, error) {
		done, err := s.st.JobTimeOutStuck(ctx, s.cfg.BatchSize, types)
		s.traceTimeouts(ctx, done)
		return len(done), err
	}))
	if err := s.rescue(ctx, &rep); err != nil {
		errs = append(errs, err)
	}
	add(s.drain(ctx, "expired", &rep.Expired, func() (int, error) { return s.st.JobExpire(ctx, s.cfg.BatchSize) }))
	add(s.earlyReplies(ctx, &rep, types))
	add(s.drain(ctx, "pruned", &rep.Pruned, func() (int, error) { return s.st.JobPrune(ctx, s.cfg.Retention, s.cfg.BatchSize) }))
	add(s.drain(ctx, "dead_letters_pruned", &rep.DeadLettersPruned, func() (int, error) {
		return s.st.DeadLetterPrune(ctx, s.cfg.DeadLetterRetention, s.cfg.BatchSize)
	}))
	add(s.drain(ctx, "operations_pruned", &rep.OperationsPruned, func() (int, error) {
		return s.st.OperationPrune(ctx, s.cfg.Retention, s.cfg.BatchSize)
	}))
	s.count(rep)
	return rep, errors.Join(errs...)
}

// earlyReplies pages through every kept early reply, a batch per
// transaction in id order: each is applied if its job now runs, or
// dead-lettered (and copied to the dead-letter topic) past its TTL. So a
// flood of unmatched replies is worked off whole, never only its oldest.
func (s *Sweeper) earlyReplies(ctx context.Context, rep *Report, types correlator.Types) error {
	var after int64
	for ctx.Err() == nil {
		res, last, err := s.st.EarlyReplySweep(ctx, after, s.cfg.BatchSize, types)
		if err != nil {
			return err
		}
		rep.EarlyApplied += len(res.Applied)
		rep.EarlyDeadLettered += len(res.DeadLetters)
		s.cfg.Metrics.ObserveReplies(metrics.SourceEarly, res.Counts(), res.RoundTrips())
		s.cfg.DeadLetters.Copy(res.DeadLetters)
		if last == 0 || len(res.Verdicts) < s.cfg.BatchSize {
			return nil
		}
		after = last
	}
	return nil
}

// count adds what a sweep's report holds and drain has not counted yet
// to hipq_sweeper_actions_total; every action shows, 0 included.
func (s *Sweeper) count(rep Report) {
	for action, n := range map[string]int{"rescued": rep.Rescued, "failed_unsent": rep.FailedUnsent,
		"early_applied": rep.EarlyApplied, "early_dead_lettered": rep.EarlyDeadLettered,
		"timed_out": 0, "expired": 0, "pruned": 0, "dead_letters_pruned": 0, "operations_pruned": 0} {
		c := s.cfg.Metrics.Sweeper.WithLabelValues(action)
		if n > 0 {
			c.Add(float64(n))
		}
	}
}

// drain runs one batched step until a batch comes back short, counting
// each batch in hipq_sweeper_actions_total{action} as it lands.
func (s *Sweeper) drain(ctx context.Context, action string, total *int, step func() (int, error)) error {
	for ctx.Err() == nil {
		n, err := step()
		*total += n
		if n > 0 { // counted batch by batch: a long prune shows while it goes
			s.cfg.Metrics.Sweeper.WithLabelValues(action).Add(float64(n))
		}
		if err != nil || n < s.cfg.BatchSize {
			return err
		}
	}
	return nil
}

// rescue handles claims whose request was never acknowledged once the
// transport's send timeout plus the grace has passed: the instance that
// claimed them died between claim and send (invariant 8). Timeouts leave
// these claims alone, so the rescue is their only way out: it works
// through all of them, a batch at a time. at_least_once claims are
// undone; at_most_once claims may have been sent, so they end final /
// failed. Claims of a type this instance does not know are not searched:
// their job's own timeout ends them (store.JobTimeOutStuck).
//
// Each search reads the claims that became old enough since the one
// before (store.UnsentMarks), and every fullSearchEvery rescues all of
// them, until such a search completes; a rescue that fails, or is cut
// short, keeps the marks it started from.
func (s *Sweeper) rescue(ctx context.Context, rep *Report) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rescues%fullSearchEvery == 0 {
		s.full = true
	}
	s.rescues++
	from := s.marks
	if s.full {
		from = nil // until one completes: a failed full search is tried again
	}
	for ctx.Err() == nil {
		unsent, marks, err := s.st.AttemptFindUnsent(ctx, s.cfg.Types, s.cfg.Grace, s.cfg.BatchSize, from)
		if err != nil {
			return err
		}
		var undo []store.AttemptRef
		var fail []store.Resolve
		for _, u := range unsent {
			if resend, res := correlator.SendUnknown(s.cfg.Types.Get(u.JobType), "claimed but not known to be sent (instance lost)"); !resend {
				fail = append(fail, store.Resolve{Queue: u.Queue, JobID: u.JobID, Attempt: u.Attempt, Claim: u.Claim, Res: res})
				continue
			}
			undo = append(undo, u.AttemptRef)
		}
		// Their instance may have sent them before it died: sent again,
		// they keep counting in their rate windows.
		n, undoErr := s.st.JobUndoForResend(ctx, undo)
		rep.Rescued += n
		if n > 0 {
			s.log.Warn("claims undone: their instance died before sending", zap.Int("jobs", n))
		}
		done, failErr := s.st.JobFailUnsent(ctx, fail)
		rep.FailedUnsent += len(done)
		if len(done) > 0 {
			s.log.Warn("claims ended failed: their instance died before sending, and they may not be sent again",
				zap.Int("jobs", len(done)))
		}
		err = errors.Join(undoErr, failErr)
		// A full batch that moved something: there may be more. (One that
		// moved nothing was overtaken, by sends recorded meanwhile: the
		// next sweep reads afresh.)
		if err != nil || n+len(done) == 0 && len(unsent) > 0 {
			return err
		}
		if len(unsent) < s.cfg.BatchSize {
			s.marks = marks // every claim read was sent, or is handled now
			s.full = false
			return nil
		}
	}
	return nil
}

// traceTimeouts records a span "timeout" for each attempt timed out, a
// child of the attempt's send span (tracing on).
func (s *Sweeper) traceTimeouts(ctx context.Context, done []store.AttemptRef) {
	if s.cfg.Tracer == nil || len(done) == 0 {
		return
	}
	sends, err := s.st.AttemptTraces(ctx, done)
	if err != nil {
		s.log.Debug("cannot read the attempts' send spans", zap.Error(err))
	}
	for _, r := range done {
		tracing.RecordEnded(ctx, s.cfg.Tracer, tracing.Ended{Name: "timeout", Kind: trace.SpanKindInternal,
			Send:  correlator.TraceContext{Parent: sends[r]},
			Attrs: append(tracing.AttemptAttrs(r.JobID, r.Attempt), attribute.String("hipq.attempt.outcome", string(correlator.AttemptTimedOut)))})
	}
}

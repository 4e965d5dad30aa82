package sweeper

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// Periodic fires the configured schedules' ticks. Every instance running
// the sweeper role runs one: each tick fires once whichever gets to it,
// because a fire locks the schedule's row and moves its last fire time in
// the transaction that inserts the job.
type Periodic struct {
	log       *zap.Logger
	st        *store.Store
	schedules []*correlator.Schedule
	types     correlator.Types
	metrics   *metrics.Metrics
	// MaxSleep bounds the wait between looks, so a pause, a resume or a
	// trigger made on another instance is seen soon.
	MaxSleep time.Duration
}

// DefaultScheduleMaxSleep is Periodic.MaxSleep's default.
const DefaultScheduleMaxSleep = 30 * time.Second

// NewPeriodic builds the schedules' runner; Run starts it.
func NewPeriodic(log *zap.Logger, st *store.Store, schedules []*correlator.Schedule, types correlator.Types, m *metrics.Metrics) *Periodic {
	return &Periodic{log: log.Named("schedules"), st: st, schedules: schedules, types: types,
		metrics: metrics.Or(m), MaxSleep: DefaultScheduleMaxSleep}
}

// Run fires ticks until ctx ends. It sleeps until the earliest next tick
// (on PostgreSQL's clock, as every tick is measured) or MaxSleep; errors
// are logged and retried with a growing pause.
func (p *Periodic) Run(ctx context.Context) error {
	if len(p.schedules) == 0 {
		return nil
	}
	var since time.Time // PostgreSQL's clock at this scheduler's first look
	var synced bool
	pause := 100 * time.Millisecond
	for {
		wait, err := p.look(ctx, &since, &synced)
		if err != nil {
			if ctx.Err() != nil {
				return nil //nolint:nilerr // a stopped Run ends without an error, as on the select below
			}
			p.log.Warn("cannot fire schedules; retrying", zap.Error(err), zap.Duration("in", pause))
			wait, pause = pause, min(2*pause, 10*time.Second)
		} else {
			pause = 100 * time.Millisecond
		}
		t := time.NewTimer(min(max(wait, 0), p.MaxSleep))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// look fires what is due and returns how long until the next tick.
func (p *Periodic) look(ctx context.Context, since *time.Time, synced *bool) (time.Duration, error) {
	if !*synced {
		names := make([]string, len(p.schedules))
		for i, s := range p.schedules {
			names[i] = s.Name
		}
		if err := p.st.ScheduleSync(ctx, names); err != nil {
			return 0, err
		}
		*synced = true
	}
	states, now, err := p.st.ScheduleStates(ctx)
	if err != nil {
		return 0, err
	}
	if since.IsZero() {
		*since = now
	}
	wait := p.MaxSleep
	for _, s := range p.schedules {
		st, ok := states[s.Name]
		if !ok {
			*synced = false // the row went (a dropped schema): make it again
			continue
		}
		if st.Paused {
			// Looked at again at its next tick: a resume made meanwhile
			// is seen in time to fire that tick.
			if next := s.Next(now); !next.IsZero() {
				wait = min(wait, next.Sub(now))
			}
			continue
		}
		last := st.LastFire
		if !s.Next(last).After(now) {
			f, err := p.st.ScheduleFire(ctx, s, p.types.Get(s.JobType), *since)
			if err != nil {
				return 0, err
			}
			p.report(s, f)
			if f.Paused {
				continue // paused since the read
			}
			last = f.LastFire
		}
		if next := s.Next(last); !next.IsZero() {
			wait = min(wait, next.Sub(now))
		}
	}
	// Ticks fall on whole seconds: wake just after, not just before; and
	// never spin, whatever the clocks say.
	return max(wait+5*time.Millisecond, 50*time.Millisecond), nil
}

func (p *Periodic) report(s *correlator.Schedule, f store.Fired) {
	c := p.metrics.ScheduleFires
	for result, n := range map[string]int{"enqueued": f.Enqueued, "duplicate": f.Duplicate, "skipped": f.Skipped,
		"missed": f.Dropped, "failed": f.Failed} {
		if n > 0 {
			c.WithLabelValues(s.Name, result).Add(float64(n))
		}
	}
	for _, err := range f.Errors {
		p.log.Error("a schedule's tick could not make its job; the tick is passed over", zap.String("schedule", s.Name), zap.Error(err))
	}
	if f.Enqueued+f.Duplicate+f.Skipped+f.Dropped > 0 {
		p.log.Info("schedule fired", zap.String("schedule", s.Name), zap.Int("enqueued", f.Enqueued),
			zap.Int("duplicate", f.Duplicate), zap.Int("skipped", f.Skipped), zap.Int("missed", f.Dropped),
			zap.Time("last_fire", f.LastFire))
	}
}

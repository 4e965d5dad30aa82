package dispatcher

import (
	"slices"
	"time"

	"go.uber.org/zap"
)

// outage is a neighbour refusing sends (or whose sends could not start).
type outage struct {
	since    time.Time // the first refusal of this outage (monotonic); zero: none yet
	failures int       // probes refused in a row
	until    time.Time // no claims for it before then
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

package dispatcher

import (
	"context"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

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
// inserted and then claimed. Only types this instance sends qualify, whose
// neighbour is not backing off, without time windows or a cap of their own
// in flight: everything else is claimed as usual. In a queue with limits
// (throttle, shares, per-type concurrency, rates) the store claims under
// them (Limits). It holds room for the jobs of those types only, at most a
// batch (BatchSize), and none while the queue has a backlog (the
// dispatcher's last round claimed a full batch, or, in a queue with
// limits, left due jobs waiting for room: those jobs come first). It
// returns nil when there is no room, the queue is not served here, or the
// dispatcher is stopping.
func (d *Dispatcher) Reserve(queue string, jobTypes []string) *Reservation {
	i := slices.IndexFunc(d.cfg.Queues, func(q QueueConfig) bool { return q.Name == queue })
	if i < 0 || len(jobTypes) == 0 {
		return nil
	}
	q := d.cfg.Queues[i]
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
	k := d.room.reserve(min(n, d.cfg.BatchSize))
	if k <= 0 {
		return nil
	}
	d.sends.Add(1) // Run's drain waits for what the reservation becomes
	return &Reservation{d: d, n: k, types: types, queue: q}
}

// Order is the order of the reservation's queue: the intake claims the
// jobs of a batch in it when they outnumber the room.
func (r *Reservation) Order() correlator.Order { return r.queue.Order }

// Limits are the limits of the reservation's queue (the zero Throttle:
// none), under which the store claims the jobs as it stores them.
func (r *Reservation) Limits() store.IntakeLimits {
	return store.IntakeLimits{Throttle: r.queue.Throttle, Order: r.queue.Order}
}

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
	r.d.room.release(r.n)
	r.n = -1
	r.d.sends.Done()
	r.d.Wake()
}

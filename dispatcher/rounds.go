package dispatcher

import (
	"context"
	"errors"
	"maps"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/store"
)

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
	if d.room.available() > 0 {
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
	// In a queue whose last round did not claim a full batch nor leave
	// due jobs waiting for room under its limits, most wake-ups (a batch
	// stored and claimed by the intake, a delivery recorded, a job ended)
	// find nothing due. A probe says so for a tenth of a claim's cost,
	// without the claim lock of a queue with limits (which the intake's
	// claims wait for), and is wider than the claim (the same due jobs,
	// whatever their windows and limits), so it never keeps a due job
	// from its claim. A failed probe leaves the answer to the claim.
	d.mu.Lock()
	full := d.backlog[q.Name]
	d.mu.Unlock()
	if !full {
		due, err := d.st.JobsDue(ctx, q.Name, types)
		if err != nil {
			d.log.Debug("probe for due jobs failed; claiming", zap.String("queue", q.Name), zap.Error(err))
		} else if !due {
			add(d.m.ClaimRounds.WithLabelValues(q.Name, "nothing_due"), 1)
			return 0, false, nil
		}
	}
	total, more, held, ran := 0, false, false, false
	var errs []error
	claim := func(types []string, limit int) {
		if len(types) == 0 {
			return
		}
		// The room is taken before the claim (the intake takes it too:
		// Reserve), and what the claim did not use given back after its
		// deliveries started, which count their own jobs.
		limit = d.room.reserve(min(limit, d.cfg.BatchSize))
		if limit <= 0 {
			return // a delivery finishing wakes the dispatcher
		}
		n, full, h, err := d.claim(ctx, q, types, limit)
		d.room.release(limit)
		total, more, held, ran = total+n, more || full, held || h, true
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
		d.backlog[q.Name] = more || held
		d.mu.Unlock()
	}
	return total, more, errors.Join(errs...)
}

// claim claims up to limit due jobs of the given types and starts their
// deliveries. It returns how many jobs it claimed or deferred, whether
// that was the limit (more may be due), and whether the queue's limits
// held due jobs back (store.Claim.Held).
func (d *Dispatcher) claim(ctx context.Context, q QueueConfig, types []string, limit int) (int, bool, bool, error) {
	claim, err := d.st.JobClaim(ctx, store.JobClaimParams{Queue: q.Name, Order: q.Order, Limit: limit,
		Instance: d.cfg.Instance, Types: types, Throttle: q.Throttle, TypeWindows: d.typeWindows})
	if err != nil {
		return 0, false, false, err
	}
	if claim.WindowsErr != nil {
		d.log.Warn("due jobs with time windows were not claimed; they wait for a later claim",
			zap.String("queue", q.Name), zap.Error(claim.WindowsErr))
	}
	if !claim.RateFreeAt.IsZero() {
		d.wakeAt(time.Now().Add(claim.RateFreeAt.Sub(claim.Now())))
	}
	n := len(claim.Jobs) + len(claim.Closed)
	more := n >= limit // (a bounded claim may also return the jobs it deferred)
	result := "empty"
	if n > 0 {
		result = "claimed"
	}
	add(d.m.ClaimRounds.WithLabelValues(q.Name, result), 1)
	if len(claim.Jobs) > 0 {
		add(d.m.Claimed.WithLabelValues(q.Name), len(claim.Jobs))
		d.dispatch(ctx, q, claim.Jobs)
	}
	return n, more, claim.Held, d.deferClosed(ctx, q, &claim)
}

// deferClosed moves due jobs found outside their time windows to their next
// opening without using an attempt, or ends them final / expired when that
// opening is past their expiry (they are never sent), as the claim
// decided (store.Closed.Deferral, on the claim's clock).
func (d *Dispatcher) deferClosed(ctx context.Context, q QueueConfig, claim *store.Claim) error {
	if len(claim.Closed) == 0 {
		return nil
	}
	ds := make([]store.Deferral, 0, len(claim.Closed))
	expired := 0
	for _, c := range claim.Closed {
		if c.Deferral.Expire {
			expired++
		}
		ds = append(ds, c.Deferral)
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

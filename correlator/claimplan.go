package correlator

import (
	"fmt"
	"math"
	"time"
)

// ClaimInput is everything one claim of a queue decides from: the queue's
// limits, what runs now, and its due jobs in the queue's order. The store
// reads Usage and Candidates under the queue's claim lock, so nothing it
// read changes before it writes the plan.
type ClaimInput struct {
	// Throttle is the queue's limits.
	Throttle Throttle
	// Batch is the most jobs the claim takes; at least 1.
	Batch int
	// Now is the claim's clock (PostgreSQL's now() of the claim's
	// transaction): time windows are judged by it and deferrals start from
	// it.
	Now time.Time
	// TypeWindows are the compiled time windows of each job type; a
	// candidate without windows of its own has its type's.
	TypeWindows map[string][]TimeWindow
	// Usage is what counts against the limits before this claim.
	Usage ClaimUsage
	// Candidates are due jobs (waiting, their time come, not expired) in
	// the queue's order. The store may leave out jobs that could not be
	// taken whatever this claim takes (a full type, partition or rate
	// window, a job heavier than the room left), as hipq_claim does: the
	// plan of the rest is the same.
	Candidates []ClaimCandidate
}

// ClaimUsage is what counts against a queue's limits before a claim.
type ClaimUsage struct {
	// Used is the total throttle_factor of the queue's running
	// non-critical jobs. Read only when Throttle.Limit >= 1.
	Used int
	// Running is the number of running jobs of each type, critical or
	// not. Only types in Throttle.MaxConcurrency are read.
	Running map[string]int
	// Shares is the total throttle_factor of running non-critical jobs in
	// each share partition: a value listed in Shares.Caps, or
	// OtherPartition for every other value (absent and null included).
	Shares map[string]int
	// Rates holds each rate window that counts requests now. A window not
	// listed counts none.
	Rates map[RateWindow]RateUsage
}

// RateWindow names one sliding window of a rate: the rate's Key and the
// part, the value at the rate's Path in job_data ("" when the rate has no
// Path or the value is missing).
type RateWindow struct {
	Key  string
	Part string
}

// RateUsage is what a rate window counts before a claim.
type RateUsage struct {
	// Count is the requests that count in the window now (hipq_rate_count).
	Count int
	// FreeAt is the earliest moment one of the window's timed units stops
	// counting (its last request's arrival plus the rate's Period); zero
	// when every unit is still in flight. It is read for every window that
	// counts, not only full ones, since the claim may fill a window and
	// then reports when it frees.
	FreeAt time.Time
}

// ClaimCandidate is one due job as the claim sees it.
type ClaimCandidate struct {
	ID int64
	// State and Attempt are the job's as read; the store's write is
	// guarded by them.
	State   State
	Attempt int
	JobType string
	// Factor is the job's throttle_factor.
	Factor int
	// Share is the job's value at Throttle.Shares.Path as text (job_data
	// #>> path); nil when the value is missing or null. Read only when the
	// queue has shares.
	Share *string
	// RateParts holds, for each of Throttle.Rates in order, the job's value
	// at the rate's Path as text, "" when the rate has no Path or the value
	// is missing (coalesce(job_data #>> path, '')). Its length is
	// len(Throttle.Rates).
	RateParts []string
	// TimeWindows are the job's own compiled windows; nil means its type's.
	TimeWindows []TimeWindow
	// ExpiresAt is the job's expiry; nil never expires.
	ExpiresAt *time.Time
}

// ClaimPlan is what a claim does: the store moves Take to running, writes
// one rate unit per Units entry, and writes Defer, each write guarded by
// the state and attempt the job was read in.
type ClaimPlan struct {
	// Take are the jobs to move to running, in the queue's order.
	Take []ClaimTake
	// Units are the requests Take sends under each rate window, in the
	// order the windows were first used.
	Units []ClaimUnit
	// Defer are the candidates found outside their time windows, in the
	// queue's order: each moves to its next opening without using an
	// attempt, or ends expired when that opening is too late.
	Defer []ClaimDeferral
	// Skip are the candidates passed over because a limit had no room for
	// them, in the queue's order.
	Skip []ClaimSkip
	// RateFreeAt is when the earliest full rate window frees, on the
	// claim's clock: zero when none is full or every full window's units
	// are still in flight (they are timed when their sends end), and zero
	// when the queue was full before the walk, which then plans nothing.
	RateFreeAt time.Time
	// More says the walk used every candidate while the batch had room and
	// the queue as a whole was not full: candidates after the last one
	// read might be taken, so the store reads further when its read was
	// cut short. It is a hint; reading further may find nothing to take.
	More bool
}

// ClaimTake is a job the claim moves to running.
type ClaimTake struct {
	// Index is the job's position in ClaimInput.Candidates.
	Index   int
	ID      int64
	State   State
	Attempt int
}

// ClaimUnit is the requests a claim sends under one rate window: one
// hipq_rate_unit row, whose number is added to the window's count.
type ClaimUnit struct {
	Window RateWindow
	// Takes are positions in ClaimPlan.Take, in order.
	Takes []int
}

// ClaimDeferral is a due job outside its time windows: not taken, it
// waits for RunAt without using an attempt, or ends final / expired when
// Expire (its next opening is at or past its expiry).
type ClaimDeferral struct {
	// Index is the job's position in ClaimInput.Candidates.
	Index   int
	ID      int64
	State   State
	Attempt int
	RunAt   time.Time
	Expire  bool
}

// ClaimSkip is a due job a limit had no room for in this claim.
type ClaimSkip struct {
	// Index is the job's position in ClaimInput.Candidates.
	Index  int
	ID     int64
	Reason SkipReason
}

// SkipReason names the limit that passed a job over.
type SkipReason string

const (
	// SkipTypeCapped: its type runs MaxConcurrency jobs.
	SkipTypeCapped SkipReason = "type_capped"
	// SkipRateFull: a rate window that applies to it is at its limit.
	SkipRateFull SkipReason = "rate_full"
	// SkipThrottleFull: it is heavier than what is left of the queue's
	// Limit.
	SkipThrottleFull SkipReason = "throttle_full"
	// SkipShareFull: its share partition has no room for its factor.
	SkipShareFull SkipReason = "share_full"
)

// PlanClaim decides which of a queue's due jobs one claim takes, walking
// the candidates in the queue's order. A candidate outside its time
// windows is deferred. Otherwise, on a queue with limits
// (Throttle.Bounded), it is skipped when its type is at its cap, when a
// rate window that applies to it is full, when it is not critical and is
// heavier than what is left of the Limit, or when its share partition has
// no room for it; else it is taken and counts against every limit that
// applies to it before the next candidate is looked at. The walk stops
// when the batch is full, or when the queue is full and has no critical
// type (nothing else could pass); a queue full before the walk plans
// nothing. These are the rules of hipq_claim's walk: a job is passed over
// only for a limit it does not fit in, and a job passed over never holds
// back the jobs after it.
func PlanClaim(in ClaimInput) (ClaimPlan, error) {
	if err := in.check(); err != nil {
		return ClaimPlan{}, err
	}
	w := newClaimWalk(&in)
	var plan ClaimPlan
	fullAtStart := w.bounded && w.queueFull()
	stopped := fullAtStart
	for i := 0; i < len(in.Candidates) && !stopped; i++ {
		c := &in.Candidates[i]
		ws := c.TimeWindows
		if ws == nil {
			ws = in.TypeWindows[c.JobType]
		}
		if !windowsOpen(ws, in.Now) {
			d := Defer(ws, c.ExpiresAt, in.Now)
			plan.Defer = append(plan.Defer, ClaimDeferral{Index: i, ID: c.ID, State: c.State, Attempt: c.Attempt, RunAt: d.RunAt, Expire: d.Expire})
			continue
		}
		if w.bounded {
			if reason := w.room(c); reason != "" {
				plan.Skip = append(plan.Skip, ClaimSkip{Index: i, ID: c.ID, Reason: reason})
				continue
			}
			w.add(c, len(plan.Take), &plan)
		}
		plan.Take = append(plan.Take, ClaimTake{Index: i, ID: c.ID, State: c.State, Attempt: c.Attempt})
		stopped = len(plan.Take) >= in.Batch || (w.bounded && w.queueFull())
	}
	if !stopped && len(plan.Take) < in.Batch {
		plan.More = !w.bounded || !w.queueRateFull()
	}
	if w.bounded && !fullAtStart {
		plan.RateFreeAt = w.rateFreeAt()
	}
	return plan, nil
}

// check refuses input the walk cannot judge, naming the field.
func (in *ClaimInput) check() error {
	if in.Batch < 1 {
		return fmt.Errorf("ClaimInput.Batch: %d, must be at least 1", in.Batch)
	}
	if in.Now.IsZero() {
		return fmt.Errorf("ClaimInput.Now: zero; the claim's clock is required to judge time windows")
	}
	rates := in.Throttle.Rates
	for k := range rates {
		for j := range k {
			if rates[j].Key == rates[k].Key {
				return fmt.Errorf("ClaimInput.Throttle.Rates[%d].Key: %q is also Rates[%d]'s; a window is named by its rate's key", k, rates[k].Key, j)
			}
		}
	}
	for i := range in.Candidates {
		c := &in.Candidates[i]
		if len(c.RateParts) != len(rates) {
			return fmt.Errorf("ClaimInput.Candidates[%d].RateParts: %d parts for %d rates; one per rate is required", i, len(c.RateParts), len(rates))
		}
		for k, p := range c.RateParts {
			if p != "" && len(rates[k].Path) == 0 {
				return fmt.Errorf("ClaimInput.Candidates[%d].RateParts[%d]: %q for rate %q, which has no path; its part is \"\"", i, k, p, rates[k].Key)
			}
		}
	}
	return nil
}

// windowsOpen reports whether now falls in one of the compiled windows;
// no windows is always open.
func windowsOpen(ws []TimeWindow, now time.Time) bool {
	if len(ws) == 0 {
		return true
	}
	for i := range ws {
		if ws[i].Contains(now) {
			return true
		}
	}
	return false
}

// claimWalk is the usage as the walk counts it: what the input read plus
// what the walk took so far. The input's maps are never written.
type claimWalk struct {
	in       *ClaimInput
	bounded  bool
	limit    int // the queue's Limit; math.MaxInt when it has none
	used     int
	critical map[string]bool
	shares   *Shares // nil unless the queue has shares under a Limit
	running  map[string]int
	parts    map[string]int
	rates    map[RateWindow]int // requests taken in this claim by window
	units    map[RateWindow]int // position in ClaimPlan.Units
}

func newClaimWalk(in *ClaimInput) *claimWalk {
	t := &in.Throttle
	w := &claimWalk{in: in, bounded: t.Bounded(), limit: math.MaxInt}
	if t.Limit >= 1 {
		w.limit, w.used = t.Limit, in.Usage.Used
		if t.Shares != nil {
			w.shares = t.Shares
			w.parts = map[string]int{}
		}
	}
	if len(t.Critical) > 0 {
		w.critical = make(map[string]bool, len(t.Critical))
		for _, name := range t.Critical {
			w.critical[name] = true
		}
	}
	if len(t.MaxConcurrency) > 0 {
		w.running = map[string]int{}
	}
	if len(t.Rates) > 0 {
		w.rates, w.units = map[RateWindow]int{}, map[RateWindow]int{}
	}
	return w
}

// queueFull: nothing but a critical job could be taken, and the queue has
// no critical type.
func (w *claimWalk) queueFull() bool {
	return w.used >= w.limit && len(w.in.Throttle.Critical) == 0
}

// queueRateFull: a rate over every job of the queue, with no path, is
// full, so no job could be taken.
func (w *claimWalk) queueRateFull() bool {
	for _, r := range w.in.Throttle.Rates {
		if r.Type == "" && len(r.Path) == 0 && w.rateCount(RateWindow{Key: r.Key}) >= r.Limit {
			return true
		}
	}
	return false
}

func (w *claimWalk) rateCount(win RateWindow) int {
	return w.in.Usage.Rates[win].Count + w.rates[win]
}

// partition is the share partition of c and its cap (0: unbounded).
func (w *claimWalk) partition(c *ClaimCandidate) (string, int) {
	return w.shares.PartitionOf(c.Share)
}

// room is why c cannot be taken now, or "" when every limit has room.
func (w *claimWalk) room(c *ClaimCandidate) SkipReason {
	t := &w.in.Throttle
	if most, ok := t.MaxConcurrency[c.JobType]; ok && w.in.Usage.Running[c.JobType]+w.running[c.JobType] >= most {
		return SkipTypeCapped
	}
	for k := range t.Rates {
		r := &t.Rates[k]
		if r.Type != "" && r.Type != c.JobType {
			continue
		}
		if w.rateCount(RateWindow{Key: r.Key, Part: c.RateParts[k]}) >= r.Limit {
			return SkipRateFull
		}
	}
	if w.critical[c.JobType] {
		return ""
	}
	if c.Factor > w.limit-w.used {
		return SkipThrottleFull
	}
	if w.shares != nil {
		part, most := w.partition(c)
		if most > 0 && w.in.Usage.Shares[part]+w.parts[part]+c.Factor > most {
			return SkipShareFull
		}
	}
	return ""
}

// add counts c, the take at position take of plan, against every limit
// that applies to it.
func (w *claimWalk) add(c *ClaimCandidate, take int, plan *ClaimPlan) {
	t := &w.in.Throttle
	if !w.critical[c.JobType] {
		w.used += c.Factor
		if w.shares != nil {
			part, _ := w.partition(c)
			w.parts[part] += c.Factor
		}
	}
	if _, ok := t.MaxConcurrency[c.JobType]; ok {
		w.running[c.JobType]++
	}
	for k := range t.Rates {
		r := &t.Rates[k]
		if r.Type != "" && r.Type != c.JobType {
			continue
		}
		win := RateWindow{Key: r.Key, Part: c.RateParts[k]}
		w.rates[win]++
		u, ok := w.units[win]
		if !ok {
			u = len(plan.Units)
			w.units[win] = u
			plan.Units = append(plan.Units, ClaimUnit{Window: win})
		}
		plan.Units[u].Takes = append(plan.Units[u].Takes, take)
	}
}

// rateFreeAt is the earliest moment a full window frees: the least FreeAt
// of the windows at their limit after the walk. A window the walk opened
// holds only requests in flight, which free nothing until their sends end.
func (w *claimWalk) rateFreeAt() time.Time {
	rates := w.in.Throttle.Rates
	if len(rates) == 0 {
		return time.Time{}
	}
	limits := make(map[string]int, len(rates))
	for _, r := range rates {
		limits[r.Key] = r.Limit
	}
	var at time.Time
	for win, u := range w.in.Usage.Rates {
		limit, ok := limits[win.Key]
		if !ok || u.FreeAt.IsZero() || u.Count+w.rates[win] < limit {
			continue
		}
		if at.IsZero() || u.FreeAt.Before(at) {
			at = u.FreeAt
		}
	}
	return at
}

package correlator

import (
	"maps"
	"math"
	"slices"
)

// ClaimNarrow is what a read of a queue's due jobs may leave out before
// PlanClaim walks them: jobs no claim could take from this usage on,
// whatever it takes first (usage only grows within a claim). Leaving them
// out changes no plan (ClaimInput.Candidates), and keeps a backlog that
// cannot run (a type at its cap, a full rate window) from crowding the
// read.
type ClaimNarrow struct {
	// Nothing: no job can be taken (the queue is full and has no critical
	// type, or its queue-wide rate window is full): read nothing.
	Nothing bool
	// SkipTypes are types none of whose jobs can be taken: at their cap,
	// or under a full rate window of the type as a whole.
	SkipTypes []string
	// MaxFactor is the heaviest throttle_factor a job of a type not in
	// Throttle.Critical may have; math.MaxInt32 when the queue has no
	// Limit.
	MaxFactor int
	// FullShares are the listed share partitions with no room left, and
	// OtherFull says the pooled partition has none (Throttle.Shares).
	FullShares []string
	OtherFull  bool
	// FullParts are the full windows of rates with a Path: jobs whose part
	// is listed (of the rate's Type, when it has one) cannot be taken.
	FullParts []FullRateParts
	// Most is the most jobs a claim can take: the room left under the
	// queue's Limit when it has no critical type (every job weighs at
	// least 1), else math.MaxInt32. A read needs no more candidates than
	// it takes, but for those a limit passes over.
	Most int
}

// FullRateParts are the full windows of one rate with a Path.
type FullRateParts struct {
	Rate  int // its index in Throttle.Rates
	Parts []string
}

// NarrowClaim says what a claim of a queue limited by t, with usage u,
// may leave unread: the walk's own rules (PlanClaim), applied to what no
// job can change.
func NarrowClaim(t Throttle, u ClaimUsage) ClaimNarrow {
	in := ClaimInput{Throttle: t, Usage: u}
	w := newClaimWalk(&in)
	n := ClaimNarrow{MaxFactor: math.MaxInt32, Most: math.MaxInt32}
	if !w.bounded {
		return n
	}
	if w.queueFull() || w.queueRateFull() {
		return ClaimNarrow{Nothing: true}
	}
	if t.Limit >= 1 {
		n.MaxFactor = max(t.Limit-u.Used, 0)
		if len(t.Critical) == 0 {
			n.Most = n.MaxFactor
		}
	}
	for name, most := range t.MaxConcurrency {
		if u.Running[name] >= most {
			n.SkipTypes = append(n.SkipTypes, name)
		}
	}
	for k, r := range t.Rates {
		if len(r.Path) > 0 {
			var full []string
			for win, ru := range u.Rates {
				if win.Key == r.Key && ru.Count >= r.Limit {
					full = append(full, win.Part)
				}
			}
			if len(full) > 0 {
				slices.Sort(full)
				n.FullParts = append(n.FullParts, FullRateParts{Rate: k, Parts: full})
			}
			continue
		}
		if r.Type != "" && w.rateCount(RateWindow{Key: r.Key}) >= r.Limit && !slices.Contains(n.SkipTypes, r.Type) {
			n.SkipTypes = append(n.SkipTypes, r.Type)
		}
	}
	slices.Sort(n.SkipTypes)
	if w.shares != nil {
		for part, most := range w.shares.Caps {
			if u.Shares[part] >= most {
				n.FullShares = append(n.FullShares, part)
			}
		}
		slices.Sort(n.FullShares)
		n.OtherFull = w.shares.OtherCap > 0 && u.Shares[OtherPartition] >= w.shares.OtherCap
	}
	return n
}

// Skips reports whether n leaves c out of the read: true only for a job
// PlanClaim would never take from the usage n was made from on.
func (n *ClaimNarrow) Skips(t *Throttle, c *ClaimCandidate) bool {
	if n.Nothing || slices.Contains(n.SkipTypes, c.JobType) {
		return true
	}
	for _, f := range n.FullParts {
		r := &t.Rates[f.Rate]
		if (r.Type == "" || r.Type == c.JobType) && slices.Contains(f.Parts, c.RateParts[f.Rate]) {
			return true
		}
	}
	if slices.Contains(t.Critical, c.JobType) {
		return false
	}
	if c.Factor > n.MaxFactor {
		return true
	}
	if t.Shares != nil && t.Limit >= 1 {
		part, _ := t.Shares.PartitionOf(c.Share)
		if part == OtherPartition {
			return n.OtherFull
		}
		return slices.Contains(n.FullShares, part)
	}
	return false
}

// Add counts the plan's takes into the usage u it was planned from: the
// usage a further read of candidates is narrowed by (NarrowClaim). The
// input's maps are not written.
func (p *ClaimPlan) Add(in *ClaimInput) ClaimUsage {
	u := ClaimUsage{Used: in.Usage.Used, Running: maps.Clone(in.Usage.Running), Shares: maps.Clone(in.Usage.Shares)}
	if len(in.Usage.Rates) > 0 || len(p.Units) > 0 {
		u.Rates = make(map[RateWindow]RateUsage, len(in.Usage.Rates)+len(p.Units))
		for w, r := range in.Usage.Rates {
			u.Rates[w] = r
		}
	}
	t := &in.Throttle
	for _, take := range p.Take {
		c := &in.Candidates[take.Index]
		u.Add(t, c.JobType, c.Share, 1, c.Factor)
	}
	for _, unit := range p.Units {
		r := u.Rates[unit.Window]
		r.Count += len(unit.Takes)
		u.Rates[unit.Window] = r
	}
	return u
}

// Add counts n running jobs of jobType, of total throttle_factor factor
// and share value share (nil: missing or null), against the limits of t
// they count in: Used and Shares for a type not critical (under a Limit),
// Running for a capped type.
func (u *ClaimUsage) Add(t *Throttle, jobType string, share *string, n, factor int) {
	if t.Limit >= 1 && !slices.Contains(t.Critical, jobType) {
		u.Used += factor
		if t.Shares != nil {
			part, _ := t.Shares.PartitionOf(share)
			u.Shares = addTo(u.Shares, part, factor)
		}
	}
	if _, ok := t.MaxConcurrency[jobType]; ok {
		u.Running = addTo(u.Running, jobType, n)
	}
}

func addTo(m map[string]int, k string, n int) map[string]int {
	if m == nil {
		m = map[string]int{}
	}
	m[k] += n
	return m
}

package correlator

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// planModel is a brute-force reading of the claim's rules: before each
// candidate it counts every limit again from the usage read and the jobs
// taken so far, so it shares no bookkeeping with PlanClaim.
type planModel struct {
	in ClaimInput
}

// planCount is every limit's count after the jobs at positions taken.
type planCount struct {
	used    int
	running map[string]int
	parts   map[string]int
	rates   map[RateWindow]int
}

func (m planModel) critical(jobType string) bool {
	return slices.Contains(m.in.Throttle.Critical, jobType)
}

func (m planModel) partition(c ClaimCandidate) string {
	if c.Share != nil {
		if _, ok := m.in.Throttle.Shares.Caps[*c.Share]; ok {
			return *c.Share
		}
	}
	return OtherPartition
}

func (m planModel) partCap(p string) int {
	if p == OtherPartition {
		return m.in.Throttle.Shares.OtherCap
	}
	return m.in.Throttle.Shares.Caps[p]
}

func (m planModel) sharesOn() bool { return m.in.Throttle.Shares != nil && m.in.Throttle.Limit >= 1 }

func (m planModel) applies(r Rate, c ClaimCandidate) bool { return r.Type == "" || r.Type == c.JobType }

func (m planModel) count(taken []int) planCount {
	in := m.in
	n := planCount{running: map[string]int{}, parts: map[string]int{}, rates: map[RateWindow]int{}}
	if in.Throttle.Limit >= 1 {
		n.used = in.Usage.Used
	}
	for k, v := range in.Usage.Running {
		n.running[k] = v
	}
	for k, v := range in.Usage.Shares {
		n.parts[k] = v
	}
	for k, v := range in.Usage.Rates {
		n.rates[k] = v.Count
	}
	for _, i := range taken {
		c := in.Candidates[i]
		if !m.critical(c.JobType) {
			n.used += c.Factor
			if m.sharesOn() {
				n.parts[m.partition(c)] += c.Factor
			}
		}
		n.running[c.JobType]++
		for k, r := range in.Throttle.Rates {
			if m.applies(r, c) {
				n.rates[RateWindow{Key: r.Key, Part: c.RateParts[k]}]++
			}
		}
	}
	return n
}

func (m planModel) open(c ClaimCandidate) bool {
	ws := c.TimeWindows
	if ws == nil {
		ws = m.in.TypeWindows[c.JobType]
	}
	return NextAllowed(ws, m.in.Now).Equal(m.in.Now)
}

// why is the limit that has no room for c after taken, or "".
func (m planModel) why(c ClaimCandidate, n planCount) SkipReason {
	t := m.in.Throttle
	if most, ok := t.MaxConcurrency[c.JobType]; ok && n.running[c.JobType] >= most {
		return SkipTypeCapped
	}
	for k, r := range t.Rates {
		if m.applies(r, c) && n.rates[RateWindow{Key: r.Key, Part: c.RateParts[k]}] >= r.Limit {
			return SkipRateFull
		}
	}
	if m.critical(c.JobType) {
		return ""
	}
	if t.Limit >= 1 && n.used+c.Factor > t.Limit {
		return SkipThrottleFull
	}
	if m.sharesOn() {
		p := m.partition(c)
		if most := m.partCap(p); most > 0 && n.parts[p]+c.Factor > most {
			return SkipShareFull
		}
	}
	return ""
}

// full: the walk stops before anything more.
func (m planModel) full(taken []int) bool {
	t := m.in.Throttle
	if len(taken) >= m.in.Batch {
		return true
	}
	return t.Bounded() && t.Limit >= 1 && len(t.Critical) == 0 && m.count(taken).used >= t.Limit
}

// plan is what the rules say, and how many candidates the walk looked at.
func (m planModel) plan() (want planWant, seen int) {
	var taken []int
	bounded := m.in.Throttle.Bounded()
	for i, c := range m.in.Candidates {
		if m.full(taken) {
			break
		}
		seen = i + 1
		if !m.open(c) {
			want.deferred = append(want.deferred, c.ID)
			continue
		}
		if bounded {
			if r := m.why(c, m.count(taken)); r != "" {
				if want.skip == nil {
					want.skip = map[int64]SkipReason{}
				}
				want.skip[c.ID] = r
				continue
			}
		}
		taken = append(taken, i)
		want.take = append(want.take, c.ID)
	}
	n := m.count(taken)
	if seen == len(m.in.Candidates) && !m.full(taken) {
		want.more = true
		for _, r := range m.in.Throttle.Rates {
			if r.Type == "" && len(r.Path) == 0 && n.rates[RateWindow{Key: r.Key}] >= r.Limit {
				want.more = false
			}
		}
	}
	if bounded && !m.full(nil) {
		for win, u := range m.in.Usage.Rates {
			for _, r := range m.in.Throttle.Rates {
				if r.Key == win.Key && !u.FreeAt.IsZero() && n.rates[win] >= r.Limit &&
					(want.rateFreeAt.IsZero() || u.FreeAt.Before(want.rateFreeAt)) {
					want.rateFreeAt = u.FreeAt
				}
			}
		}
	}
	return want, seen
}

// randomClaim builds a queue with random limits, usage and candidates.
func randomClaim(t testing.TB, rng *rand.Rand) ClaimInput {
	types := []string{"a", "b", "c", "d"}
	pick := func(xs []string) string { return xs[rng.IntN(len(xs))] }
	closed, open := closedWindows(t), openWindows(t)
	in := ClaimInput{Batch: 1 + rng.IntN(10), Now: planNow}
	th := &in.Throttle
	if rng.IntN(4) > 0 {
		th.Limit = 1 + rng.IntN(12)
	}
	for _, ty := range types {
		if rng.IntN(5) == 0 {
			th.Critical = append(th.Critical, ty)
		}
		if rng.IntN(3) == 0 {
			if th.MaxConcurrency == nil {
				th.MaxConcurrency = map[string]int{}
			}
			th.MaxConcurrency[ty] = rng.IntN(4)
		}
	}
	if th.Limit >= 1 && rng.IntN(2) == 0 {
		weights := map[string]int{}
		for _, v := range []string{"x", "y", OtherPartition} {
			if rng.IntN(2) == 0 {
				weights[v] = 1 + rng.IntN(4)
			}
		}
		if len(weights) == 0 {
			weights["x"] = 1
		}
		th.Shares = shares(t, weights, th.Limit)
	}
	for k := range rng.IntN(4) {
		jobType, ptr := "", ""
		if rng.IntN(2) == 0 {
			jobType = pick(types)
		}
		if rng.IntN(2) == 0 {
			ptr = "/h"
		}
		th.Rates = append(th.Rates, rate(t, fmt.Sprintf("r#%d", k), 1+rng.IntN(4), jobType, ptr))
	}
	if rng.IntN(3) == 0 {
		in.TypeWindows = map[string][]TimeWindow{pick(types): closed, pick(types): open}
	}

	u := &in.Usage
	u.Used = rng.IntN(th.Limit + 3)
	u.Running = map[string]int{}
	for _, ty := range types {
		u.Running[ty] = rng.IntN(4)
	}
	u.Shares = map[string]int{}
	for _, p := range []string{"x", "y", OtherPartition} {
		u.Shares[p] = rng.IntN(5)
	}
	u.Rates = map[RateWindow]RateUsage{}
	for _, r := range append(slices.Clone(th.Rates), Rate{Key: "gone#0"}) {
		for _, p := range []string{"", "p", "q"} {
			if rng.IntN(3) == 0 {
				continue
			}
			ru := RateUsage{Count: rng.IntN(r.Limit + 2)}
			if rng.IntN(3) > 0 {
				ru.FreeAt = planNow.Add(time.Duration(1+rng.IntN(60)) * time.Second)
			}
			u.Rates[RateWindow{Key: r.Key, Part: p}] = ru
		}
	}

	for i := range rng.IntN(30) {
		c := ClaimCandidate{ID: int64(100 + i), State: StateInitial, Attempt: rng.IntN(3), JobType: pick(types), Factor: 1 + rng.IntN(4)}
		if c.Attempt > 0 {
			c.State = StateRetry
		}
		switch rng.IntN(6) {
		case 0:
			c.TimeWindows = closed
		case 1:
			c.TimeWindows = open
		case 2:
			c.TimeWindows = []TimeWindow{}
		}
		switch rng.IntN(3) {
		case 0:
			at := planNow.Add(time.Hour)
			c.ExpiresAt = &at
		case 1:
			at := planNow.Add(48 * time.Hour)
			c.ExpiresAt = &at
		}
		if rng.IntN(5) > 0 {
			c.Share = str(pick([]string{"x", "y", "z", "*"}))
		}
		c.RateParts = make([]string, len(th.Rates))
		for k, r := range th.Rates {
			if len(r.Path) > 0 {
				c.RateParts[k] = pick([]string{"", "p", "q"})
			}
		}
		in.Candidates = append(in.Candidates, c)
	}
	return in
}

// Random queues, usage and candidates: the plan is the brute-force
// model's, and holds the claim's guarantees checked on their own: no limit
// is exceeded, no job is skipped that fit when it was looked at, the walk
// covers a prefix of the candidates in order and stops only when it must,
// no share with room is starved, and the deferrals are exactly the closed
// candidates the walk looked at.
func TestPlanClaimMatchesModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(31, 1))
	for iter := range 5000 {
		in := randomClaim(t, rng)
		plan, err := PlanClaim(in)
		if err != nil {
			t.Fatalf("iteration %d: %v", iter, err)
		}
		m := planModel{in: in}
		want, seen := m.plan()
		if got := planGot(plan); !got.equal(want) {
			t.Fatalf("iteration %d: %+v\ngot  %v\nwant %v", iter, in, got, want)
		}
		if err := checkPlan(m, plan, seen); err != nil {
			t.Fatalf("iteration %d: %v\ninput %+v\nplan %+v", iter, err, in, plan)
		}
	}
}

// checkPlan checks plan's guarantees against in, given that the walk
// looked at the first seen candidates.
func checkPlan(m planModel, plan ClaimPlan, seen int) error {
	in := m.in
	th := in.Throttle

	// Every candidate the walk looked at is taken, skipped or deferred,
	// once, in order; none after.
	kind := make([]byte, len(in.Candidates))
	last := -1
	var taken []int
	mark := func(i int, k byte, id int64) error {
		if i <= last {
			return fmt.Errorf("candidate %d out of order", i)
		}
		if in.Candidates[i].ID != id {
			return fmt.Errorf("candidate %d: id %d, want %d", i, id, in.Candidates[i].ID)
		}
		last, kind[i] = i, k
		return nil
	}
	// Walk the three lists merged by position.
	ti, si, di := 0, 0, 0
	for i := range in.Candidates {
		var err error
		switch {
		case ti < len(plan.Take) && plan.Take[ti].Index == i:
			err = mark(i, 't', plan.Take[ti].ID)
			taken = append(taken, i)
			ti++
		case si < len(plan.Skip) && plan.Skip[si].Index == i:
			err = mark(i, 's', plan.Skip[si].ID)
			si++
		case di < len(plan.Defer) && plan.Defer[di].Index == i:
			err = mark(i, 'd', plan.Defer[di].ID)
			di++
		}
		if err != nil {
			return err
		}
	}
	if ti != len(plan.Take) || si != len(plan.Skip) || di != len(plan.Defer) {
		return fmt.Errorf("a candidate listed twice or out of order")
	}
	for i := range seen {
		if kind[i] == 0 {
			return fmt.Errorf("candidate %d looked at but neither taken, skipped nor deferred", i)
		}
	}
	for i := seen; i < len(in.Candidates); i++ {
		if kind[i] != 0 {
			return fmt.Errorf("candidate %d after the walk stopped is in the plan", i)
		}
	}
	// The walk stops early only when the batch is full or the queue is
	// full without critical types.
	if seen < len(in.Candidates) && !m.full(taken) {
		return fmt.Errorf("the walk stopped at %d with room left", seen)
	}
	if len(plan.Take) > in.Batch {
		return fmt.Errorf("%d taken, batch %d", len(plan.Take), in.Batch)
	}

	// Takes carry the expected state and attempt.
	for _, x := range plan.Take {
		if c := in.Candidates[x.Index]; x.State != c.State || x.Attempt != c.Attempt {
			return fmt.Errorf("take %d: state %s attempt %d, want %s %d", x.ID, x.State, x.Attempt, c.State, c.Attempt)
		}
	}

	// No limit is exceeded: counted again from scratch after the plan, a
	// count is within its limit, or no more than it was before.
	before, after := m.count(nil), m.count(taken)
	within := func(what string, b, a, limit int) error {
		if a > max(b, limit) || (b >= limit && a != b) {
			return fmt.Errorf("%s: %d before, %d after, limit %d", what, b, a, limit)
		}
		return nil
	}
	if th.Limit >= 1 {
		if err := within("throttle", before.used, after.used, th.Limit); err != nil {
			return err
		}
	}
	for ty, most := range th.MaxConcurrency {
		if err := within("type "+ty, before.running[ty], after.running[ty], most); err != nil {
			return err
		}
	}
	if m.sharesOn() {
		for p := range after.parts {
			if most := m.partCap(p); most > 0 {
				if err := within("share "+p, before.parts[p], after.parts[p], most); err != nil {
					return err
				}
			}
		}
	}
	for win, a := range after.rates {
		for _, r := range th.Rates {
			if r.Key == win.Key {
				if err := within(fmt.Sprintf("rate %v", win), before.rates[win], a, r.Limit); err != nil {
					return err
				}
			}
		}
	}

	// Every skip is justified: given what was taken before it, taking it
	// would have broken the limit it names.
	for _, s := range plan.Skip {
		var prior []int
		for _, x := range plan.Take {
			if x.Index < s.Index {
				prior = append(prior, x.Index)
			}
		}
		if r := m.why(in.Candidates[s.Index], m.count(prior)); r != s.Reason {
			return fmt.Errorf("skip %d for %s; the limits say %q", s.ID, s.Reason, r)
		}
		if !th.Bounded() {
			return fmt.Errorf("skip %d on a queue without limits", s.ID)
		}
	}

	// No share is starved: a partition that got nothing had no room, from
	// the start, for any of its candidates the walk passed over as share
	// full.
	if m.sharesOn() {
		got := map[string]bool{}
		for _, x := range plan.Take {
			if c := in.Candidates[x.Index]; !m.critical(c.JobType) {
				got[m.partition(c)] = true
			}
		}
		for _, s := range plan.Skip {
			c := in.Candidates[s.Index]
			p := m.partition(c)
			if s.Reason == SkipShareFull && !got[p] && before.parts[p]+c.Factor <= m.partCap(p) {
				return fmt.Errorf("share %s starved: job %d (factor %d) skipped with %d of %d used", p, c.ID, c.Factor, before.parts[p], m.partCap(p))
			}
		}
	}

	// The deferrals are exactly the closed candidates the walk looked at,
	// each as Defer decides.
	var closed []int
	for i := range seen {
		if !m.open(in.Candidates[i]) {
			closed = append(closed, i)
		}
	}
	if len(closed) != len(plan.Defer) {
		return fmt.Errorf("%d deferred, %d closed candidates looked at", len(plan.Defer), len(closed))
	}
	for j, d := range plan.Defer {
		c := in.Candidates[closed[j]]
		ws := c.TimeWindows
		if ws == nil {
			ws = in.TypeWindows[c.JobType]
		}
		want := Defer(ws, c.ExpiresAt, in.Now)
		if d.Index != closed[j] || !d.RunAt.Equal(want.RunAt) || d.Expire != want.Expire || d.State != c.State || d.Attempt != c.Attempt {
			return fmt.Errorf("deferral %+v, want candidate %d run at %v expire %v", d, closed[j], want.RunAt, want.Expire)
		}
	}

	// Units hold every take under each window that applies to it, once.
	units := map[RateWindow][]int{}
	for _, u := range plan.Units {
		if _, dup := units[u.Window]; dup {
			return fmt.Errorf("window %v has two units", u.Window)
		}
		units[u.Window] = u.Takes
	}
	wantUnits := map[RateWindow][]int{}
	for j, x := range plan.Take {
		c := in.Candidates[x.Index]
		for k, r := range th.Rates {
			if m.applies(r, c) {
				w := RateWindow{Key: r.Key, Part: c.RateParts[k]}
				wantUnits[w] = append(wantUnits[w], j)
			}
		}
	}
	if len(units) != len(wantUnits) {
		return fmt.Errorf("units %v, want %v", units, wantUnits)
	}
	for w, js := range wantUnits {
		if !slices.Equal(units[w], js) {
			return fmt.Errorf("unit %v: takes %v, want %v", w, units[w], js)
		}
	}
	return nil
}

// BenchmarkPlanClaim plans a claim of 500 from 1,000 candidates of a queue
// with a limit, shares, a type cap and rates with and without paths.
func BenchmarkPlanClaim(b *testing.B) {
	th := Throttle{
		Limit:          800,
		Shares:         shares(b, map[string]int{"east": 4, "west": 3, OtherPartition: 3}, 800),
		Critical:       []string{"c"},
		MaxConcurrency: map[string]int{"b": 200},
		Rates:          []Rate{rate(b, "q#0", 5000, "", ""), rate(b, "q#1", 100, "", "/host"), rate(b, "t:b#0", 300, "b", "")},
	}
	usage := ClaimUsage{Used: 100, Running: map[string]int{"b": 20}, Shares: map[string]int{"east": 50, "west": 30, OtherPartition: 20},
		Rates: map[RateWindow]RateUsage{}}
	for h := range 50 {
		usage.Rates[RateWindow{Key: "q#1", Part: fmt.Sprintf("h%d", h)}] = RateUsage{Count: 80, FreeAt: planNow.Add(time.Second)}
	}
	usage.Rates[RateWindow{Key: "q#0"}] = RateUsage{Count: 1000, FreeAt: planNow.Add(time.Second)}
	regions := []string{"east", "west", "north", "south"}
	types := []string{"a", "b", "c"}
	cands := make([]ClaimCandidate, 1000)
	for i := range cands {
		cands[i] = ClaimCandidate{ID: int64(i + 1), State: StateInitial, JobType: types[i%len(types)], Factor: 1 + i%2,
			Share: &regions[i%len(regions)], RateParts: []string{"", fmt.Sprintf("h%d", i%60), ""}}
	}
	in := ClaimInput{Throttle: th, Batch: 500, Now: planNow, Usage: usage, Candidates: cands}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := PlanClaim(in); err != nil {
			b.Fatal(err)
		}
	}
}

// The narrowing of a claim's read (NarrowClaim) leaves out only jobs the
// walk would not take: planning the candidates it keeps takes the same
// jobs, in the same order, as planning them all; and a read in two parts,
// the second narrowed by the usage after the first's plan (ClaimPlan.Add),
// does too.
func TestNarrowClaimChangesNoPlan(t *testing.T) {
	rng := rand.New(rand.NewPCG(32, 1))
	left := 0 // candidates the narrowing left out, over all iterations
	defer func() {
		if left == 0 && !t.Failed() {
			t.Fatal("the narrowing never left a candidate out: the test tests nothing")
		}
	}()
	for iter := range 5000 {
		in := randomClaim(t, rng)
		// (Deferrals need the clock of the whole read; the narrowing is of
		// limits, so the comparison is of takes.)
		full, err := PlanClaim(in)
		if err != nil {
			t.Fatalf("iteration %d: %v", iter, err)
		}
		n := NarrowClaim(in.Throttle, in.Usage)
		kept := in
		kept.Candidates = nil
		for i := range in.Candidates {
			if !n.Skips(&in.Throttle, &in.Candidates[i]) {
				kept.Candidates = append(kept.Candidates, in.Candidates[i])
			} else {
				left++
			}
		}
		if len(full.Take) > n.Most {
			t.Fatalf("iteration %d: the plan takes %d jobs, the narrowing says at most %d\ninput %+v", iter, len(full.Take), n.Most, in)
		}
		for _, take := range full.Take {
			if n.Skips(&in.Throttle, &in.Candidates[take.Index]) {
				t.Fatalf("iteration %d: the narrowing leaves out job %d, which the plan takes\ninput %+v\nnarrow %+v", iter, take.ID, in, n)
			}
		}
		narrowed, err := PlanClaim(kept)
		if err != nil {
			t.Fatalf("iteration %d: %v", iter, err)
		}
		if a, b := takenIDs(full), takenIDs(narrowed); !slices.Equal(a, b) {
			t.Fatalf("iteration %d: takes %v of all candidates, %v of the narrowed read\ninput %+v\nnarrow %+v", iter, a, b, in, n)
		}
		// In two parts: the first half planned, the second narrowed by the
		// usage after it.
		half := len(in.Candidates) / 2
		first := in
		first.Candidates = in.Candidates[:half]
		p1, err := PlanClaim(first)
		if err != nil {
			t.Fatalf("iteration %d: %v", iter, err)
		}
		if len(p1.Take) >= in.Batch {
			continue
		}
		n2 := NarrowClaim(in.Throttle, p1.Add(&first))
		both := first
		both.Candidates = slices.Clone(first.Candidates)
		for i := half; i < len(in.Candidates); i++ {
			if !n2.Skips(&in.Throttle, &in.Candidates[i]) {
				both.Candidates = append(both.Candidates, in.Candidates[i])
			}
		}
		p2, err := PlanClaim(both)
		if err != nil {
			t.Fatalf("iteration %d: %v", iter, err)
		}
		if a, b := takenIDs(full), takenIDs(p2); !slices.Equal(a, b) {
			t.Fatalf("iteration %d: takes %v of all candidates, %v read in two parts\ninput %+v", iter, a, b, in)
		}
	}
}

func takenIDs(p ClaimPlan) []int64 {
	var ids []int64
	for _, t := range p.Take {
		ids = append(ids, t.ID)
	}
	return ids
}

package correlator

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"
)

var planNow = time.Date(2025, 3, 10, 12, 0, 0, 0, time.UTC)

// closedWindows are closed at planNow (12:00 UTC) and open next at 01:00
// the next day; openWindows are open at planNow.
func closedWindows(t testing.TB) []TimeWindow {
	ws := []TimeWindow{{Start: "01:00", End: "02:00"}}
	if err := CompileWindows(ws); err != nil {
		t.Fatal(err)
	}
	return ws
}

func openWindows(t testing.TB) []TimeWindow {
	ws := []TimeWindow{{Start: "11:00", End: "13:00"}}
	if err := CompileWindows(ws); err != nil {
		t.Fatal(err)
	}
	return ws
}

func str(s string) *string { return &s }

// cj is a candidate of jobType with factor and no rate parts; edit it
// for the rest.
func cj(id int64, jobType string, factor int) ClaimCandidate {
	return ClaimCandidate{ID: id, State: StateInitial, JobType: jobType, Factor: factor}
}

func with(c ClaimCandidate, f func(*ClaimCandidate)) ClaimCandidate {
	f(&c)
	return c
}

func shares(t testing.TB, weights map[string]int, limit int) *Shares {
	s, err := NewShares("/s", weights, limit)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func rate(t testing.TB, key string, limit int, jobType, pointer string) Rate {
	r, err := NewRate(key, limit, time.Minute, jobType, pointer)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

type planWant struct {
	take       []int64
	skip       map[int64]SkipReason
	deferred   []int64
	more       bool
	rateFreeAt time.Time
}

func planGot(p ClaimPlan) planWant {
	var g planWant
	for _, x := range p.Take {
		g.take = append(g.take, x.ID)
	}
	for _, x := range p.Skip {
		if g.skip == nil {
			g.skip = map[int64]SkipReason{}
		}
		g.skip[x.ID] = x.Reason
	}
	for _, x := range p.Defer {
		g.deferred = append(g.deferred, x.ID)
	}
	g.more, g.rateFreeAt = p.More, p.RateFreeAt
	return g
}

func (w planWant) String() string {
	return fmt.Sprintf("take %v skip %v defer %v more %v rateFreeAt %v", w.take, w.skip, w.deferred, w.more, w.rateFreeAt)
}

func (w planWant) equal(o planWant) bool {
	return slices.Equal(w.take, o.take) && maps.Equal(w.skip, o.skip) && slices.Equal(w.deferred, o.deferred) &&
		w.more == o.more && w.rateFreeAt.Equal(o.rateFreeAt)
}

// Each case is named for the rule of hipq_claim's walk it shows.
func TestPlanClaimRules(t *testing.T) {
	closed, open := closedWindows(t), openWindows(t)
	inFlight := time.Time{}
	soon, later := planNow.Add(10*time.Second), planNow.Add(30*time.Second)
	part := func(p string) func(*ClaimCandidate) { return func(c *ClaimCandidate) { c.RateParts = []string{p} } }
	share := func(v string) func(*ClaimCandidate) { return func(c *ClaimCandidate) { c.Share = str(v) } }
	own := func(ws []TimeWindow) func(*ClaimCandidate) { return func(c *ClaimCandidate) { c.TimeWindows = ws } }
	oneRate := func(c ClaimCandidate) ClaimCandidate { return with(c, part("")) }
	tests := []struct {
		name string
		in   ClaimInput
		want planWant
	}{
		{
			name: "unbounded queue takes due jobs in order up to the batch",
			in:   ClaimInput{Batch: 3, Candidates: []ClaimCandidate{cj(1, "a", 1), cj(2, "b", 5), cj(3, "a", 1), cj(4, "a", 1)}},
			want: planWant{take: []int64{1, 2, 3}},
		},
		{
			name: "unbounded queue that runs out of candidates asks for more",
			in:   ClaimInput{Batch: 3, Candidates: []ClaimCandidate{cj(1, "a", 1)}},
			want: planWant{take: []int64{1}, more: true},
		},
		{
			name: "a job outside its own windows is deferred, not taken",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 10},
				Candidates: []ClaimCandidate{with(cj(1, "a", 1), own(closed)), with(cj(2, "a", 1), own(open))}},
			want: planWant{take: []int64{2}, deferred: []int64{1}, more: true},
		},
		{
			name: "a job without windows of its own has its type's; empty own windows are open all day",
			in: ClaimInput{Batch: 5, TypeWindows: map[string][]TimeWindow{"a": closed},
				Candidates: []ClaimCandidate{cj(1, "a", 1), with(cj(2, "a", 1), own([]TimeWindow{})), cj(3, "b", 1)}},
			want: planWant{take: []int64{2, 3}, deferred: []int64{1}, more: true},
		},
		{
			name: "deferred jobs do not use the batch",
			in: ClaimInput{Batch: 1, Throttle: Throttle{Limit: 10},
				Candidates: []ClaimCandidate{with(cj(1, "a", 1), own(closed)), with(cj(2, "a", 1), own(closed)), cj(3, "a", 1), with(cj(4, "a", 1), own(closed))}},
			want: planWant{take: []int64{3}, deferred: []int64{1, 2}},
		},
		{
			name: "a job outside its windows is deferred even when a limit would skip it",
			in: ClaimInput{Batch: 5, Throttle: Throttle{MaxConcurrency: map[string]int{"a": 1}}, Usage: ClaimUsage{Running: map[string]int{"a": 1}},
				Candidates: []ClaimCandidate{with(cj(1, "a", 1), own(closed)), cj(2, "a", 1)}},
			want: planWant{skip: map[int64]SkipReason{2: SkipTypeCapped}, deferred: []int64{1}, more: true},
		},
		{
			name: "a type at its cap is skipped; jobs taken count toward the cap",
			in: ClaimInput{Batch: 5, Throttle: Throttle{MaxConcurrency: map[string]int{"a": 2}}, Usage: ClaimUsage{Running: map[string]int{"a": 1, "b": 9}},
				Candidates: []ClaimCandidate{cj(1, "a", 1), cj(2, "a", 1), cj(3, "b", 1)}},
			want: planWant{take: []int64{1, 3}, skip: map[int64]SkipReason{2: SkipTypeCapped}, more: true},
		},
		{
			name: "a cap holds a critical type too",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 5, Critical: []string{"c"}, MaxConcurrency: map[string]int{"c": 1}},
				Usage:      ClaimUsage{Running: map[string]int{"c": 1}},
				Candidates: []ClaimCandidate{cj(1, "c", 1), cj(2, "a", 1)}},
			want: planWant{take: []int64{2}, skip: map[int64]SkipReason{1: SkipTypeCapped}, more: true},
		},
		{
			name: "a rate window at its limit is skipped; jobs taken count in the window",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Rates: []Rate{rate(t, "q#0", 2, "", "")}},
				Usage:      ClaimUsage{Rates: map[RateWindow]RateUsage{{Key: "q#0"}: {Count: 1}}},
				Candidates: []ClaimCandidate{oneRate(cj(1, "a", 1)), oneRate(cj(2, "a", 1)), oneRate(cj(3, "b", 1))}},
			want: planWant{take: []int64{1}, skip: map[int64]SkipReason{2: SkipRateFull, 3: SkipRateFull}},
		},
		{
			name: "a rate with a type applies to that type only",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Rates: []Rate{rate(t, "t:a#0", 1, "a", "")}},
				Usage:      ClaimUsage{Rates: map[RateWindow]RateUsage{{Key: "t:a#0"}: {Count: 1}}},
				Candidates: []ClaimCandidate{oneRate(cj(1, "a", 1)), oneRate(cj(2, "b", 1))}},
			want: planWant{take: []int64{2}, skip: map[int64]SkipReason{1: SkipRateFull}, more: true},
		},
		{
			name: "a rate with a path has a window per value; a missing value is the \"\" window",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Rates: []Rate{rate(t, "q#0", 1, "", "/host")}},
				Usage: ClaimUsage{Rates: map[RateWindow]RateUsage{{Key: "q#0", Part: "x"}: {Count: 1}}},
				Candidates: []ClaimCandidate{with(cj(1, "a", 1), part("x")), with(cj(2, "a", 1), part("y")),
					with(cj(3, "a", 1), part("")), with(cj(4, "a", 1), part("y")), with(cj(5, "a", 1), part(""))}},
			want: planWant{take: []int64{2, 3}, skip: map[int64]SkipReason{1: SkipRateFull, 4: SkipRateFull, 5: SkipRateFull}, more: true},
		},
		{
			name: "a rate applies to critical types",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 5, Critical: []string{"c"}, Rates: []Rate{rate(t, "q#0", 1, "", "")}},
				Usage:      ClaimUsage{Rates: map[RateWindow]RateUsage{{Key: "q#0"}: {Count: 1}}},
				Candidates: []ClaimCandidate{oneRate(cj(1, "c", 1))}},
			want: planWant{skip: map[int64]SkipReason{1: SkipRateFull}},
		},
		{
			name: "a job heavier than what is left of the limit is skipped; lighter ones after it are taken",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 5}, Usage: ClaimUsage{Used: 1},
				Candidates: []ClaimCandidate{cj(1, "a", 3), cj(2, "a", 2), cj(3, "a", 1), cj(4, "a", 1)}},
			want: planWant{take: []int64{1, 3}, skip: map[int64]SkipReason{2: SkipThrottleFull}},
		},
		{
			name: "a full queue without critical types stops the walk: nothing after is deferred",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 2},
				Candidates: []ClaimCandidate{cj(1, "a", 2), with(cj(2, "a", 1), own(closed)), cj(3, "a", 1)}},
			want: planWant{take: []int64{1}},
		},
		{
			name: "a queue full before the walk plans nothing",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 2, Rates: []Rate{rate(t, "q#0", 1, "", "")}},
				Usage:      ClaimUsage{Used: 2, Rates: map[RateWindow]RateUsage{{Key: "q#0"}: {Count: 1, FreeAt: soon}}},
				Candidates: []ClaimCandidate{with(oneRate(cj(1, "a", 1)), own(closed)), oneRate(cj(2, "a", 1))}},
			want: planWant{},
		},
		{
			name: "a full queue with a critical type walks on and takes only critical jobs",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 2, Critical: []string{"c"}}, Usage: ClaimUsage{Used: 2},
				Candidates: []ClaimCandidate{cj(1, "a", 1), cj(2, "c", 7), with(cj(3, "a", 1), own(closed)), cj(4, "c", 1)}},
			want: planWant{take: []int64{2, 4}, skip: map[int64]SkipReason{1: SkipThrottleFull}, deferred: []int64{3}, more: true},
		},
		{
			name: "a full batch stops the walk: nothing after is deferred",
			in: ClaimInput{Batch: 2, Throttle: Throttle{Limit: 10},
				Candidates: []ClaimCandidate{cj(1, "a", 1), cj(2, "a", 1), with(cj(3, "a", 1), own(closed))}},
			want: planWant{take: []int64{1, 2}},
		},
		{
			name: "a share partition with no room for the job is skipped; jobs taken count in it",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 8, Shares: shares(t, map[string]int{"east": 1, "west": 3}, 8)}, // east 2, west 6
				Usage: ClaimUsage{Used: 1, Shares: map[string]int{"east": 1}},
				Candidates: []ClaimCandidate{with(cj(1, "a", 2), share("east")), with(cj(2, "a", 1), share("east")),
					with(cj(3, "a", 1), share("east")), with(cj(4, "a", 3), share("west"))}},
			want: planWant{take: []int64{2, 4}, skip: map[int64]SkipReason{1: SkipShareFull, 3: SkipShareFull}, more: true},
		},
		{
			name: "values not listed, missing or null share the other cap",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 4, Shares: shares(t, map[string]int{"east": 1, "*": 1}, 4)}, // east 2, * 2
				Candidates: []ClaimCandidate{with(cj(1, "a", 1), share("north")), cj(2, "a", 1), with(cj(3, "a", 1), share("south")),
					with(cj(4, "a", 2), share("east"))}},
			want: planWant{take: []int64{1, 2, 4}, skip: map[int64]SkipReason{3: SkipShareFull}},
		},
		{
			name: "without a \"*\" weight, values not listed are bound only by the limit",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 4, Shares: shares(t, map[string]int{"east": 1}, 4)},
				Candidates: []ClaimCandidate{with(cj(1, "a", 3), share("north")), cj(2, "a", 1)}},
			want: planWant{take: []int64{1, 2}},
		},
		{
			name: "the limit is checked before the share",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 4, Shares: shares(t, map[string]int{"east": 1, "west": 1}, 4)},
				Usage:      ClaimUsage{Used: 3, Shares: map[string]int{"east": 2}},
				Candidates: []ClaimCandidate{with(cj(1, "a", 2), share("east"))}},
			want: planWant{skip: map[int64]SkipReason{1: SkipThrottleFull}, more: true},
		},
		{
			name: "critical jobs count against neither the limit nor shares",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 2, Critical: []string{"c"}, Shares: shares(t, map[string]int{"east": 1, "west": 1}, 2)},
				Usage: ClaimUsage{Used: 1, Shares: map[string]int{"east": 1}},
				Candidates: []ClaimCandidate{with(cj(1, "c", 5), share("east")), with(cj(2, "a", 1), share("west")),
					with(cj(3, "c", 1), share("west"))}},
			want: planWant{take: []int64{1, 2, 3}, more: true},
		},
		{
			name: "a type's cap is checked before rates, rates before the limit",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 1, Critical: []string{"c"}, MaxConcurrency: map[string]int{"a": 1}, Rates: []Rate{rate(t, "t:b#0", 1, "b", "")}},
				Usage:      ClaimUsage{Used: 1, Running: map[string]int{"a": 1}, Rates: map[RateWindow]RateUsage{{Key: "t:b#0"}: {Count: 1}}},
				Candidates: []ClaimCandidate{oneRate(cj(1, "a", 1)), oneRate(cj(2, "b", 1)), oneRate(cj(3, "d", 1))}},
			want: planWant{skip: map[int64]SkipReason{1: SkipTypeCapped, 2: SkipRateFull, 3: SkipThrottleFull}, more: true},
		},
		{
			name: "RateFreeAt is when the earliest full window frees",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Rates: []Rate{rate(t, "q#0", 1, "", "/h")}},
				Usage: ClaimUsage{Rates: map[RateWindow]RateUsage{
					{Key: "q#0", Part: "x"}: {Count: 1, FreeAt: later},
					{Key: "q#0", Part: "y"}: {Count: 1, FreeAt: soon.Add(5 * time.Second)},
					{Key: "q#0", Part: "z"}: {Count: 0, FreeAt: soon}, // not full
					{Key: "gone#0"}:         {Count: 9, FreeAt: soon}, // not a rate of the queue
				}},
				Candidates: []ClaimCandidate{with(cj(1, "a", 1), part("x"))}},
			want: planWant{skip: map[int64]SkipReason{1: SkipRateFull}, more: true, rateFreeAt: soon.Add(5 * time.Second)},
		},
		{
			name: "RateFreeAt is zero when a full window's units are all in flight",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Rates: []Rate{rate(t, "q#0", 1, "", "")}},
				Usage:      ClaimUsage{Rates: map[RateWindow]RateUsage{{Key: "q#0"}: {Count: 1, FreeAt: inFlight}}},
				Candidates: []ClaimCandidate{oneRate(cj(1, "a", 1))}},
			want: planWant{skip: map[int64]SkipReason{1: SkipRateFull}},
		},
		{
			name: "a window the walk fills reports when its earlier units free",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Rates: []Rate{rate(t, "q#0", 2, "", "")}},
				Usage:      ClaimUsage{Rates: map[RateWindow]RateUsage{{Key: "q#0"}: {Count: 1, FreeAt: later}}},
				Candidates: []ClaimCandidate{oneRate(cj(1, "a", 1)), oneRate(cj(2, "a", 1))}},
			want: planWant{take: []int64{1}, skip: map[int64]SkipReason{2: SkipRateFull}, rateFreeAt: later},
		},
		{
			name: "a window the walk opens and fills frees nothing yet",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Rates: []Rate{rate(t, "q#0", 1, "", "/h")}},
				Candidates: []ClaimCandidate{with(cj(1, "a", 1), part("x")), with(cj(2, "a", 1), part("x"))}},
			want: planWant{take: []int64{1}, skip: map[int64]SkipReason{2: SkipRateFull}, more: true},
		},
		{
			name: "no more candidates are needed when a queue-wide rate is full",
			in: ClaimInput{Batch: 5, Throttle: Throttle{Limit: 9, Rates: []Rate{rate(t, "q#0", 1, "", "")}},
				Candidates: []ClaimCandidate{oneRate(cj(1, "a", 1))}},
			want: planWant{take: []int64{1}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.in.Now = planNow
			plan, err := PlanClaim(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			if got := planGot(plan); !got.equal(tt.want) {
				t.Errorf("got  %v\nwant %v", got, tt.want)
			}
		})
	}
}

// A deferral carries the job's expected state and attempt and runs at the
// next opening of its windows, or expires when that opening is at or past
// its expiry, as Defer decides.
func TestPlanClaimDeferralRunsAtNextOpeningOrExpires(t *testing.T) {
	closed := closedWindows(t)
	nextOpen := time.Date(2025, 3, 11, 1, 0, 0, 0, time.UTC)
	soon, late := planNow.Add(time.Hour), nextOpen.Add(time.Hour)
	in := ClaimInput{Batch: 5, Now: planNow, Candidates: []ClaimCandidate{
		{ID: 1, State: StateRetry, Attempt: 3, JobType: "a", Factor: 1, TimeWindows: closed},
		{ID: 2, State: StateInitial, JobType: "a", Factor: 1, TimeWindows: closed, ExpiresAt: &soon},
		{ID: 3, State: StateInitial, JobType: "a", Factor: 1, TimeWindows: closed, ExpiresAt: &late},
		{ID: 4, State: StateInitial, JobType: "a", Factor: 1, TimeWindows: closed, ExpiresAt: &nextOpen},
	}}
	plan, err := PlanClaim(in)
	if err != nil {
		t.Fatal(err)
	}
	want := []ClaimDeferral{
		{Index: 0, ID: 1, State: StateRetry, Attempt: 3, RunAt: nextOpen},
		{Index: 1, ID: 2, State: StateInitial, RunAt: nextOpen, Expire: true},
		{Index: 2, ID: 3, State: StateInitial, RunAt: nextOpen},
		{Index: 3, ID: 4, State: StateInitial, RunAt: nextOpen, Expire: true},
	}
	if !slices.EqualFunc(plan.Defer, want, func(a, b ClaimDeferral) bool {
		return a.Index == b.Index && a.ID == b.ID && a.State == b.State && a.Attempt == b.Attempt && a.RunAt.Equal(b.RunAt) && a.Expire == b.Expire
	}) {
		t.Fatalf("deferrals %+v, want %+v", plan.Defer, want)
	}
	if len(plan.Take) != 0 || len(plan.Skip) != 0 {
		t.Fatalf("take %+v skip %+v, want none", plan.Take, plan.Skip)
	}
}

// A take carries the job's position, id, and the state and attempt the
// store's write is guarded by; Units group the takes by the rate windows
// they count in, so the store writes one unit per window.
func TestPlanClaimTakesAndUnits(t *testing.T) {
	in := ClaimInput{Batch: 10, Now: planNow,
		Throttle: Throttle{Rates: []Rate{rate(t, "q#0", 100, "", ""), rate(t, "t:b#0", 100, "b", "/h")}},
		Candidates: []ClaimCandidate{
			{ID: 10, State: StateInitial, JobType: "a", Factor: 1, RateParts: []string{"", "x"}},
			{ID: 11, State: StateRetry, Attempt: 2, JobType: "b", Factor: 1, RateParts: []string{"", "x"}},
			{ID: 12, State: StateInitial, JobType: "b", Factor: 1, RateParts: []string{"", "y"}},
			{ID: 13, State: StateInitial, JobType: "b", Factor: 1, RateParts: []string{"", "x"}},
		}}
	plan, err := PlanClaim(in)
	if err != nil {
		t.Fatal(err)
	}
	wantTake := []ClaimTake{{0, 10, StateInitial, 0}, {1, 11, StateRetry, 2}, {2, 12, StateInitial, 0}, {3, 13, StateInitial, 0}}
	if !slices.Equal(plan.Take, wantTake) {
		t.Fatalf("take %+v, want %+v", plan.Take, wantTake)
	}
	wantUnits := []ClaimUnit{
		{Window: RateWindow{Key: "q#0"}, Takes: []int{0, 1, 2, 3}},
		{Window: RateWindow{Key: "t:b#0", Part: "x"}, Takes: []int{1, 3}},
		{Window: RateWindow{Key: "t:b#0", Part: "y"}, Takes: []int{2}},
	}
	if !slices.EqualFunc(plan.Units, wantUnits, func(a, b ClaimUnit) bool { return a.Window == b.Window && slices.Equal(a.Takes, b.Takes) }) {
		t.Fatalf("units %+v, want %+v", plan.Units, wantUnits)
	}
}

// PlanClaim never writes the usage it is given: the store may keep it.
func TestPlanClaimLeavesItsInputAlone(t *testing.T) {
	in := ClaimInput{Batch: 10, Now: planNow,
		Throttle: Throttle{Limit: 10, MaxConcurrency: map[string]int{"a": 5}, Shares: shares(t, map[string]int{"x": 1}, 10),
			Rates: []Rate{rate(t, "q#0", 100, "", "")}},
		Usage: ClaimUsage{Used: 1, Running: map[string]int{"a": 1}, Shares: map[string]int{"x": 1},
			Rates: map[RateWindow]RateUsage{{Key: "q#0"}: {Count: 1}}},
		Candidates: []ClaimCandidate{{ID: 1, JobType: "a", Factor: 1, Share: str("x"), RateParts: []string{""}}}}
	if _, err := PlanClaim(in); err != nil {
		t.Fatal(err)
	}
	if in.Usage.Used != 1 || in.Usage.Running["a"] != 1 || in.Usage.Shares["x"] != 1 || in.Usage.Rates[RateWindow{Key: "q#0"}].Count != 1 {
		t.Fatalf("usage written: %+v", in.Usage)
	}
}

func TestPlanClaimRefusesBadInput(t *testing.T) {
	r0, r1 := rate(t, "q#0", 1, "", ""), rate(t, "q#1", 1, "", "/h")
	tests := []struct {
		name string
		in   ClaimInput
		want string
	}{
		{"batch", ClaimInput{Now: planNow}, "ClaimInput.Batch: 0, must be at least 1"},
		{"now", ClaimInput{Batch: 1}, "ClaimInput.Now: zero"},
		{"rate keys", ClaimInput{Batch: 1, Now: planNow, Throttle: Throttle{Rates: []Rate{r0, r0}}}, `ClaimInput.Throttle.Rates[1].Key: "q#0" is also Rates[0]'s`},
		{"rate parts", ClaimInput{Batch: 1, Now: planNow, Throttle: Throttle{Rates: []Rate{r0, r1}},
			Candidates: []ClaimCandidate{{ID: 1, RateParts: []string{""}}}}, "ClaimInput.Candidates[0].RateParts: 1 parts for 2 rates"},
		{"part without path", ClaimInput{Batch: 1, Now: planNow, Throttle: Throttle{Rates: []Rate{r0, r1}},
			Candidates: []ClaimCandidate{{ID: 1, RateParts: []string{"x", "y"}}}}, `ClaimInput.Candidates[0].RateParts[0]: "x" for rate "q#0", which has no path`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := PlanClaim(tt.in)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err %v, want one containing %q", err, tt.want)
			}
		})
	}
}

// Due and ClaimableAtIntake, the one definition of each in Go.
func TestJobDueAndClaimableAtIntake(t *testing.T) {
	now := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	past, future := now.Add(-time.Minute), now.Add(time.Minute)
	for _, tc := range []struct {
		name           string
		job            Job
		due, claimable bool
	}{
		{"scheduled at once (zero)", Job{MaxAttempts: 1}, true, true},
		{"its time come", Job{ScheduledRunTime: past, MaxAttempts: 1}, true, true},
		{"its time exactly now", Job{ScheduledRunTime: now, MaxAttempts: 1}, true, true},
		{"later", Job{ScheduledRunTime: future, MaxAttempts: 1}, false, false},
		{"expired", Job{ExpiresAt: &past, MaxAttempts: 1}, false, false},
		{"expiring exactly now", Job{ExpiresAt: &now, MaxAttempts: 1}, false, false},
		{"expiring later", Job{ExpiresAt: &future, MaxAttempts: 1}, true, true},
		{"windows of its own", Job{TimeWindows: []TimeWindow{{Start: "00:00", End: "23:59"}}, MaxAttempts: 1}, true, false},
	} {
		if got := tc.job.Due(now); got != tc.due {
			t.Errorf("%s: Due %v, want %v", tc.name, got, tc.due)
		}
		if got := tc.job.ClaimableAtIntake(now); got != tc.claimable {
			t.Errorf("%s: ClaimableAtIntake %v, want %v", tc.name, got, tc.claimable)
		}
	}
}

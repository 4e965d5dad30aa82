package correlator

import (
	"testing"
	"time"
)

// DecideReplies decides a whole batch at once: the rows a reply names, the
// types configured, the clock and the TTL are all it reads.
func TestDecideReplies(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	id := func(n int64) *int64 { return &n }
	running := &Target{ID: 1, JobType: "t", JobKey: "a", State: StateRunning, Attempt: 1, MaxAttempts: 1}
	types := Types{"t": {Name: "t", Retry: NoRetry}}
	targets := Targets{
		ByID:   map[int64]*Target{1: running},
		ByKey:  map[TypeKey]*Target{{"t", "a"}: running},
		Finals: map[TypeKey]bool{{"t", "done"}: true},
	}
	batch := []Pending{
		{Reply: &Reply{JobType: "t", JobKey: "a", Success: true}},                                    // applies
		{Reply: &Reply{JobID: id(1), Success: true}},                                                 // the same job again: duplicate
		{Reply: &Reply{JobType: "gone", JobKey: "a", Success: true}},                                 // unknown type
		{Reply: &Reply{JobType: "t", JobKey: "done", Success: true}},                                 // only a final job: duplicate
		{Reply: &Reply{JobType: "t", JobKey: "later", Success: true}},                                // fresh early: kept
		{Reply: &Reply{JobType: "t", JobKey: "later"}, Kept: true, KeptUntil: now.Add(time.Hour)},    // kept, in time
		{Reply: &Reply{JobType: "t", JobKey: "later"}, Kept: true, KeptUntil: now.Add(-time.Second)}, // kept, too late
		{Reply: &Reply{JobID: id(9), Success: true}, Kept: true, KeptUntil: now.Add(time.Hour)},      // pruned: stale, used up
	}
	got := DecideReplies(batch, targets, types, now, 10*time.Minute)
	want := []struct {
		v    Verdict
		code string
		keep time.Time
		drop bool
	}{
		{Apply, "", time.Time{}, false},
		{Duplicate, "", time.Time{}, false},
		{DeadLetter, CodeUnknownJobType, time.Time{}, false},
		{Duplicate, "", time.Time{}, false},
		{Early, "", now.Add(10 * time.Minute), false},
		{Early, "", time.Time{}, false},
		{DeadLetter, CodeNoJob, time.Time{}, true},
		{Stale, "", time.Time{}, true},
	}
	for i, w := range want {
		d := got[i]
		code := ""
		if d.Reason != nil {
			code = d.Reason.Code
		}
		if d.Verdict != w.v || code != w.code || !d.KeepUntil.Equal(w.keep) || d.Drop != w.drop {
			t.Errorf("reply %d: %v %q keep %v drop %v, want %v %q keep %v drop %v", i, d.Verdict, code, d.KeepUntil, d.Drop, w.v, w.code, w.keep, w.drop)
		}
	}
	if r := got[0].Res; got[0].Target != running || r.State != StateFinal || r.Outcome != OutcomeSucceeded || r.Attempt != AttemptSucceeded {
		t.Errorf("applied reply: target %v, resolution %+v", got[0].Target, r)
	}
}

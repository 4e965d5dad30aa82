package correlator

import (
	"slices"
	"testing"
	"time"
)

// Each order sorts by its keys in turn, and keeps jobs not stored yet (id
// 0) in their place among equals.
func TestOrderCompare(t *testing.T) {
	now := time.Now()
	keys := map[string]OrderKey{
		"early-low":   {Scheduled: now, Priority: 1, ID: 4},
		"early-high":  {Scheduled: now, Priority: 9, ID: 3},
		"late-low":    {Scheduled: now.Add(time.Minute), Priority: 0, ID: 2},
		"late-low-id": {Scheduled: now.Add(time.Minute), Priority: 0, ID: 1},
	}
	sorted := func(o Order) []string {
		names := []string{"early-low", "early-high", "late-low", "late-low-id"}
		slices.SortStableFunc(names, func(a, b string) int { return o.Compare(keys[a], keys[b]) })
		return names
	}
	if got, want := sorted(OrderScheduledFirst), []string{"early-low", "early-high", "late-low-id", "late-low"}; !slices.Equal(got, want) {
		t.Errorf("scheduled_first: %v, want %v", got, want)
	}
	if got, want := sorted(""), sorted(OrderScheduledFirst); !slices.Equal(got, want) {
		t.Errorf("the zero order: %v, want scheduled_first's %v", got, want)
	}
	if got, want := sorted(OrderPriorityFirst), []string{"late-low-id", "late-low", "early-low", "early-high"}; !slices.Equal(got, want) {
		t.Errorf("priority_first: %v, want %v", got, want)
	}
	if OrderPriorityFirst.Columns() != "priority, scheduled_run_time, id" || Order("").Columns() != "scheduled_run_time, priority, id" {
		t.Errorf("columns: %q, %q", OrderPriorityFirst.Columns(), Order("").Columns())
	}
}

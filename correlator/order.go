package correlator

import (
	"cmp"
	"time"
)

// Order is how a queue's due jobs are claimed, everywhere a claim is made
// (the dispatcher's claims, the intake's claims of the jobs it stores):
// scheduled_first takes the earliest scheduled_run_time first, then the
// lowest priority value, then the oldest id; priority_first takes the
// lowest priority value first, then the earliest scheduled_run_time, then
// the oldest id.
type Order string

// Queue orders.
const (
	OrderScheduledFirst Order = "scheduled_first" // the default
	OrderPriorityFirst  Order = "priority_first"
)

// Orders are every queue order.
var Orders = []Order{OrderScheduledFirst, OrderPriorityFirst}

// OrderKey is what a queue's order reads of a job.
type OrderKey struct {
	Scheduled time.Time
	Priority  int
	// ID is the job's id; 0 for a job not stored yet, which then keeps its
	// place among equals (a stable sort).
	ID int64
}

// Compare says whether a comes before b (< 0), after it (> 0), or level
// with it (0) in the order o (the zero Order is scheduled_first).
func (o Order) Compare(a, b OrderKey) int {
	sched, prio := a.Scheduled.Compare(b.Scheduled), cmp.Compare(a.Priority, b.Priority)
	if o == OrderPriorityFirst {
		return cmp.Or(prio, sched, cmp.Compare(a.ID, b.ID))
	}
	return cmp.Or(sched, prio, cmp.Compare(a.ID, b.ID))
}

// Columns is the order as the columns of hipq_job an ORDER BY lists.
func (o Order) Columns() string {
	if o == OrderPriorityFirst {
		return "priority, scheduled_run_time, id"
	}
	return "scheduled_run_time, priority, id"
}

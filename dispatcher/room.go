package dispatcher

import "sync/atomic"

// room counts the claimed jobs whose sends are not recorded yet against
// Config.MaxInFlight, and is the only code that touches that count. A
// claim (a round's, or the intake's under a Reservation) reserves its
// room first and releases it once the deliveries it started hold their
// own jobs; a delivery holds its jobs until their record lands. It takes
// no lock: reserve is a compare-and-swap loop, the rest single atomic adds.
type room struct {
	max      int64
	inflight atomic.Int64
}

// reserve takes up to n jobs of room, never past max, and returns how many
// it took: 0 when none is left (or n is not positive).
func (r *room) reserve(n int) int {
	for {
		used := r.inflight.Load()
		k := min(int64(n), r.max-used)
		if k <= 0 {
			return 0
		}
		if r.inflight.CompareAndSwap(used, used+k) {
			return int(k)
		}
	}
}

// hold counts n jobs whose claim is made, whatever the room left: the
// deliveries of a claim hold their jobs before the claim releases the room
// it reserved for them, so for that moment both count, and the count
// never falls below the jobs in flight.
func (r *room) hold(n int) { r.inflight.Add(int64(n)) }

// release gives back n jobs of room that reserve took or hold counted.
func (r *room) release(n int) { r.inflight.Add(-int64(n)) }

// available is the room left: max less the jobs counted, below 0 while
// holds count past max.
func (r *room) available() int { return int(r.max - r.inflight.Load()) }

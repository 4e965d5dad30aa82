package consumer

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// Refusals the record may not be at fault for.
//
// A record PostgreSQL refuses alone is dead-lettered at once when the
// refusal is of its data (store.IsDataError). Any other refusal may be the
// system's: a privilege revoked, a column renamed under an old binary, a
// trigger failing on every row. Dead-lettering would then turn every record
// of every partition into a dead letter, so the record is compared with the
// record after it on its partition (the next outbox row for the drainer)
// that writes more than a dead letter:
//
//   - the record after it is written first, in one transaction with the
//     record, and must write: insert a job, apply a reply or move its
//     attempt's deadline (else it rolls back with store.ErrNoWrite). The records between them go
//     with it, as the offset passes over them; the outbox has no offsets
//     and leaves the rows between to the drain, reading none of them
//     again. A record that does not decode, a duplicate request, or a
//     reply that turns out duplicate, stale or for a type not configured,
//     writes nothing: it never meets the write refused and shows nothing
//     of it, so the transaction rolls back and the record after it is
//     taken instead. Nor is a record of the same input (the same job; a
//     reply to the same attempt) compared with: it would be refused for
//     its own fault just the same, and goes with the record. When the
//     record after it went through, the record is tried again after it
//     (store.IntakeRetry): refused again, the refusal is its own, and it
//     is dead-lettered in the same transaction; taken, the refusal had
//     stopped between the tries (a privilege granted back just then) and
//     it is written as if never refused. Either way the partition moves
//     on;
//   - when the record after it is refused the same way (store.SameRefusal:
//     the same SQLSTATE class), the refusal is systemic: nothing is
//     dead-lettered and no offset moves. The partition waits, trying
//     again with a backoff up to maxStallBackoff, logs the refusal once a
//     minute, sets hipq_consumer_stalled{group,reason} to 1 and makes
//     /readyz fail, until a try goes through;
//   - when it is refused otherwise, the refusal was the record's own: it
//     is dead-lettered alone, and the record after it is tried in turn.
//
// A record with no record after it in hand (the last one read) has nothing
// to be compared with: its partition waits for one, trying again with the
// same backoff, and meanwhile a refusal of the same class of another
// partition of the group counts as the record after it. It is never
// dead-lettered for waiting: on a quiet topic, every record of an outage
// would be. Still alone and refused after StallAfter, its partition is
// reported as stalled (the gauge, the log, readiness), until a record
// after it settles it or the refusal stops.
//
// A dead letter refused for a reason that is not its data (the
// dead-letter table broken) holds its record's partition the same way,
// as systemic: nothing after it can be applied until it is taken.
const (
	DefaultStallAfter = time.Minute
	maxStallBackoff   = 30 * time.Second
)

// hold is where a consumer waits: on a record (or outbox row) PostgreSQL
// refused alone for a reason that is not plainly the record's own.
type hold struct {
	at       int64     // the record's offset, or the row's id
	err      error     // the last refusal
	systemic bool      // a record after it, or of another partition, was refused the same way
	since    time.Time // first refused
	tries    int
	until    time.Time // tried again then
	paused   bool      // (consumer groups) its partition is paused until then
	// onDeadLetter: it waits on the record's dead letter, refused; its
	// tries are logged by the stall, once a minute.
	onDeadLetter bool
}

// stalls reports whether the hold is a stall to report: shown systemic,
// or waiting alone for longer than after.
func (h *hold) stalls(after time.Duration) bool {
	return h.systemic || time.Since(h.since) >= after
}

// refused records one more refusal of the held record.
func (h *hold) refused(err error, systemic bool, now time.Time) {
	h.err, h.systemic, h.onDeadLetter = err, h.systemic || systemic, false
	h.tries++
	h.until = now.Add(stallBackoff(h.tries))
}

func stallBackoff(try int) time.Duration {
	return min(100*time.Millisecond<<min(try, 9), maxStallBackoff)
}

// reason is a refusal's reason label: its SQLSTATE.
func reason(err error) string {
	if c := store.SQLState(err); c != "" {
		return c
	}
	return "unknown"
}

// stalls reports what a consumer waits on (a refusal shown systemic, or a
// record refused alone that waited StallAfter): it sets
// hipq_consumer_stalled, logs each reason once a minute and answers
// readiness.
type stalls struct {
	group string
	log   *zap.Logger
	m     *metrics.Metrics

	mu     sync.Mutex
	on     map[string]bool      // reasons whose gauge is 1
	logged map[string]time.Time // when each reason was last logged
	why    error                // nil while nothing stalls
}

func newStalls(group string, log *zap.Logger, m *metrics.Metrics) *stalls {
	return &stalls{group: group, log: log, m: m, on: map[string]bool{}, logged: map[string]time.Time{}}
}

// stalled is one place a consumer waits on a refusal it reports.
type stalled struct {
	where string // "topic/partition at offset N", "outbox row N"
	err   error
}

// set says where the consumer waits now; nothing: it flows. A reason
// that stops stalling goes back to 0 and is logged as over.
func (s *stalls) set(now []stalled) {
	s.mu.Lock()
	defer s.mu.Unlock()
	by := map[string][]stalled{}
	for _, st := range now {
		by[reason(st.err)] = append(by[reason(st.err)], st)
	}
	for r := range s.on {
		if by[r] == nil {
			s.m.Stalled.WithLabelValues(s.group, r).Set(0)
			delete(s.on, r)
			delete(s.logged, r)
			s.log.Info("consumer flows again: PostgreSQL takes its records", zap.String("group", s.group), zap.String("sqlstate", r))
		}
	}
	if len(by) == 0 {
		s.why = nil
		return
	}
	var parts []string
	for _, r := range slices.Sorted(maps.Keys(by)) {
		sts := by[r]
		if !s.on[r] {
			s.m.Stalled.WithLabelValues(s.group, r).Set(1)
			s.on[r] = true
		}
		if time.Since(s.logged[r]) >= time.Minute {
			s.logged[r] = time.Now()
			wheres := make([]string, len(sts))
			for i, st := range sts {
				wheres[i] = st.where
			}
			s.log.Error("consumer stalled: PostgreSQL refuses records for a reason not shown to be theirs; nothing is dead-lettered, it tries again",
				zap.String("group", s.group), zap.String("sqlstate", r), zap.Strings("waiting_at", wheres),
				zap.String("error", correlator.Clip(sts[0].err.Error(), 1024)))
		}
		parts = append(parts, fmt.Sprintf("SQLSTATE %s at %s (%d waiting): %s", r, sts[0].where, len(sts),
			correlator.Clip(sts[0].err.Error(), 512)))
	}
	s.why = errors.New(s.group + " stalled: PostgreSQL refuses its records for a reason not shown to be theirs: " + strings.Join(parts, "; "))
}

// err is nil while nothing stalls, else what does and why.
func (s *stalls) err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.why
}

package store

import (
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
)

// Merge appends another batch's replies after r's: their indexes (of
// applied replies and of deadlines) count on from r's.
func TestReplyResultMergeShiftsIndexes(t *testing.T) {
	at := time.Unix(100, 0)
	r := ReplyResult{
		Verdicts:    []correlator.Verdict{correlator.Apply, correlator.Progressed},
		Applied:     []AppliedReply{{Index: 0, AttemptRef: AttemptRef{Queue: "q", JobID: 1, Attempt: 1}}},
		Deadlines:   map[int]time.Time{1: at},
		DeadLetters: []DeadLetter{{Reason: "r"}},
	}
	r.Merge(ReplyResult{
		Verdicts:    []correlator.Verdict{correlator.Early, correlator.Apply, correlator.Progressed},
		Applied:     []AppliedReply{{Index: 1, AttemptRef: AttemptRef{Queue: "q", JobID: 2, Attempt: 1}}},
		Deadlines:   map[int]time.Time{2: at.Add(time.Second)},
		DeadLetters: []DeadLetter{{Reason: "o"}},
	})
	if len(r.Verdicts) != 5 || r.Verdicts[3] != correlator.Apply {
		t.Fatalf("verdicts %v, want r's then o's", r.Verdicts)
	}
	if len(r.Applied) != 2 || r.Applied[0].Index != 0 || r.Applied[1].Index != 3 || r.Applied[1].JobID != 2 {
		t.Fatalf("applied %+v, want job 1 at index 0 and job 2 at index 3", r.Applied)
	}
	if len(r.Deadlines) != 2 || !r.Deadlines[1].Equal(at) || !r.Deadlines[4].Equal(at.Add(time.Second)) {
		t.Fatalf("deadlines %v, want indexes 1 and 4", r.Deadlines)
	}
	if len(r.DeadLetters) != 2 || r.DeadLetters[1].Reason != "o" {
		t.Fatalf("dead letters %+v, want r's then o's", r.DeadLetters)
	}
	if n := r.Counts(); n[correlator.Apply] != 2 || n[correlator.Progressed] != 2 || n[correlator.Early] != 1 {
		t.Fatalf("counts %v", n)
	}
}

package sweeper

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
)

// The rescue searches from where its last search stopped (store.UnsentMarks)
// and, every fullSearchEvery rescues, from nothing: a lost claim the marks
// passed over (it became visible long after its transaction began) is
// rescued at the next full search.
func TestRescueSearchesAllNowAndThen(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	ctx := context.Background()
	types := correlator.Types{"alo": {Name: "alo", Queue: "default", Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}
	sw := New(zaptest.NewLogger(t), st, Config{Grace: time.Minute, Types: types})
	exec := func(q string) {
		t.Helper()
		if _, err := st.Pool().Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	var rep Report
	if err := sw.rescue(ctx, &rep); err != nil || len(sw.marks) != 0 {
		t.Fatalf("a rescue with no running job: marks %v: %v", sw.marks, err)
	}
	if _, err := st.JobsInsert(ctx, []*correlator.Job{{Queue: "default", JobType: "alo", JobKey: "hidden", JobData: json.RawMessage(`{}`),
		MaxAttempts: 1, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)}}); err != nil {
		t.Fatal(err)
	}
	// A claim made now, then a rescue: nothing found (the claim is
	// young), the queue's mark set.
	exec(`WITH j AS (UPDATE hipq_job SET state = 'running', attempt = 1, started_at = now() WHERE job_key = 'hidden' RETURNING id, started_at)
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at) SELECT 'default', id, 1, 'gone', started_at FROM j`)
	if err := sw.rescue(ctx, &rep); err != nil || rep.Rescued != 0 || sw.marks["default"].IsZero() {
		t.Fatalf("rescue: %+v, marks %v: %v", rep, sw.marks, err)
	}
	// The claim turns out older than the mark by more than the margin (as
	// a claim whose transaction committed long after it began): searches
	// from the marks pass it over, the next full one finds it.
	exec(`UPDATE hipq_attempt SET dispatched_at = now() - interval '1 hour'; UPDATE hipq_job SET started_at = now() - interval '1 hour'`)
	for i := 2; i < fullSearchEvery; i++ {
		if err := sw.rescue(ctx, &rep); err != nil || rep.Rescued != 0 {
			t.Fatalf("rescue %d: %+v: %v", i, rep, err)
		}
	}
	if err := sw.rescue(ctx, &rep); err != nil || rep.Rescued != 1 {
		t.Fatalf("the full search: %+v: %v", rep, err)
	}
}

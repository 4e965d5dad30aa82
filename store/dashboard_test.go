package store_test

import (
	"testing"
	"time"

	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// Two instances add to the same minute: the dashboard reads their sum;
// adding again adds (a write is a delta, never a total); rows older than
// a day go with the next write.
func TestActivity(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	now := time.Now()
	for _, add := range []struct {
		instance string
		as       []store.Activity
	}{
		{"a", []store.Activity{{Minute: now, Queue: "q", Dispatched: 3, Replied: 1}}},
		{"b", []store.Activity{{Minute: now, Queue: "q", Dispatched: 2}, {Minute: now, Queue: "r", Replied: 7}}},
		{"a", []store.Activity{{Minute: now, Queue: "q", Dispatched: 1, Replied: 1}}},
	} {
		if err := st.ActivityAdd(ctx, add.instance, add.as); err != nil {
			t.Fatal(err)
		}
	}
	got, err := st.ActivitySince(ctx, now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Queue != "q" || got[0].Dispatched != 6 || got[0].Replied != 2 || got[1].Replied != 7 ||
		!got[0].Minute.Equal(now.Truncate(time.Minute)) {
		t.Fatalf("activity: %+v", got)
	}
	if err := st.ActivityAdd(ctx, "a", []store.Activity{{Minute: now.Add(-26 * time.Hour), Queue: "q", Dispatched: 1}}); err != nil {
		t.Fatal(err)
	}
	if err := st.ActivityAdd(ctx, "a", nil); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := st.Pool().QueryRow(ctx, "SELECT count(*) FROM hipq_activity").Scan(&n); err != nil || n != 3 {
		t.Fatalf("%d rows (%v), want the old one pruned", n, err)
	}
}

// The overview counts non-final jobs only, with their weight.
func TestQueueCounts(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	if _, err := st.Pool().Exec(ctx, `INSERT INTO hipq_job (queue, job_type, job_key, job_data, state, throttle_factor, outcome)
		VALUES ('q', 't', 'a', '{}', 'running', 3, NULL), ('q', 't', 'b', '{}', 'running', 2, NULL),
		       ('q', 't', 'c', '{}', 'initial', 1, NULL), ('q', 't', 'd', '{}', 'final', 1, 'succeeded')`); err != nil {
		t.Fatal(err)
	}
	got, err := st.QueueCounts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != (store.QueueCount{Queue: "q", State: "initial", N: 1, Weight: 1}) ||
		got[1] != (store.QueueCount{Queue: "q", State: "running", N: 2, Weight: 5}) {
		t.Fatalf("counts: %+v", got)
	}
	w, err := st.RunningWeights(ctx, "q", []string{"tenant"})
	if err != nil || w[""] != 5 {
		t.Fatalf("running weights: %v %v", w, err)
	}
}

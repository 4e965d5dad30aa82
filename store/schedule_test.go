package store_test

import (
	"sync"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// Many schedulers looking at one due tick at once: one enqueues its job,
// the others find it gone (no duplicate, no second job); last_fire moves
// once. A later look with nothing due changes nothing.
func TestScheduleFireOnce(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	s := &correlator.Schedule{Name: "s", Cron: "@every 1s", JobType: "t", KeyTemplate: "k-{{.Time.Unix}}", CatchUp: correlator.CatchUpAll}
	if err := s.Compile(); err != nil {
		t.Fatal(err)
	}
	if err := st.ScheduleSync(ctx, []string{"s"}); err != nil {
		t.Fatal(err)
	}
	// Three ticks due.
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_schedule SET last_fire = date_trunc('second', now()) - interval '3 seconds'"); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var total store.Fired
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f, err := st.ScheduleFire(ctx, s, types["t"], time.Now().Add(-time.Hour))
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			total.Enqueued += f.Enqueued
			total.Duplicate += f.Duplicate
			mu.Unlock()
		}()
	}
	wg.Wait()
	if total.Enqueued != 3 || total.Duplicate != 0 {
		t.Errorf("8 schedulers: %d enqueued, %d duplicates, want 3 and 0", total.Enqueued, total.Duplicate)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_job WHERE job_type = 't'"); n != 3 {
		t.Errorf("%d jobs, want 3", n)
	}
	// Paused: due ticks make no job; resumed: they are passed over.
	dbNow := func() (n time.Time) {
		if err := st.Pool().QueryRow(ctx, "SELECT now()").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	pausedAt := dbNow()
	if err := st.ScheduleSetPaused(ctx, "s", true); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // let a tick fall due
	if f, err := st.ScheduleFire(ctx, s, types["t"], time.Now().Add(-time.Hour)); err != nil || f.Enqueued != 0 || !f.Paused {
		t.Errorf("paused: %+v %v", f, err)
	}
	if err := st.ScheduleSetPaused(ctx, "s", false); err != nil {
		t.Fatal(err)
	}
	resumedAt := dbNow()
	if _, err := st.ScheduleFire(ctx, s, types["t"], time.Now().Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_job WHERE job_type = 't'
		AND to_timestamp(substring(job_key from 3)::bigint) > $1 AND to_timestamp(substring(job_key from 3)::bigint) < $2`,
		pausedAt, resumedAt); n != 0 {
		t.Errorf("resumed: %d ticks of the pause fired", n)
	}
	if err := st.ScheduleSetPaused(ctx, "nope", true); err == nil {
		t.Error("pausing an unknown schedule")
	}
}

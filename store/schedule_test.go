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
	// Hourly, so no tick falls due while the test runs (a second-long
	// schedule raced the clock: a fourth tick fell due now and then).
	s := &correlator.Schedule{Name: "s", Cron: "@every 1h", JobType: "t", KeyTemplate: "k-{{.Time.Unix}}", CatchUp: correlator.CatchUpAll}
	if err := s.Compile(); err != nil {
		t.Fatal(err)
	}
	if err := st.ScheduleSync(ctx, []string{"s"}); err != nil {
		t.Fatal(err)
	}
	// Three ticks due.
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_schedule SET last_fire = now() - interval '3 hours' - interval '10 seconds'"); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var total store.Fired
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f, err := st.ScheduleFire(ctx, s, types["t"], time.Now().Add(-24*time.Hour))
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
	// Paused: due ticks make no job; resumed: they are passed over. (Two
	// hours pass while paused: last_fire is moved back by as much.)
	if err := st.ScheduleSetPaused(ctx, "s", true); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_schedule SET last_fire = last_fire - interval '2 hours'"); err != nil {
		t.Fatal(err)
	}
	if f, err := st.ScheduleFire(ctx, s, types["t"], time.Now().Add(-24*time.Hour)); err != nil || f.Enqueued != 0 || !f.Paused {
		t.Errorf("paused: %+v %v", f, err)
	}
	if err := st.ScheduleSetPaused(ctx, "s", false); err != nil {
		t.Fatal(err)
	}
	if _, err := st.ScheduleFire(ctx, s, types["t"], time.Now().Add(-24*time.Hour)); err != nil {
		t.Fatal(err)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_job WHERE job_type = 't'"); n != 3 {
		t.Errorf("resumed: %d jobs, want the 3 of before (the pause's ticks passed over)", n)
	}
	if err := st.ScheduleSetPaused(ctx, "nope", true); err == nil {
		t.Error("pausing an unknown schedule")
	}
}

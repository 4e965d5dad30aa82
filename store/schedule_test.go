package store_test

import (
	"errors"
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
	// (The time is computed here: Citus refuses an update that computes
	// it from the column with a STABLE operator, timestamptz - interval.)
	var last time.Time
	if err := st.Pool().QueryRow(ctx, "SELECT last_fire FROM hipq_schedule WHERE name = 's'").Scan(&last); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_schedule SET last_fire = $1 WHERE name = 's'", last.Add(-2*time.Hour)); err != nil {
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

// With overlap skip, a due tick makes no job while the schedule's last job
// is not final (read after the schedule's row is locked), and makes one
// once it is.
func TestScheduleOverlapSkip(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	s := &correlator.Schedule{Name: "o", Cron: "@every 1h", JobType: "t", KeyTemplate: "o-{{.Time.Unix}}", Overlap: correlator.OverlapSkip}
	if err := s.Compile(); err != nil {
		t.Fatal(err)
	}
	if err := st.ScheduleSync(ctx, []string{"o"}); err != nil {
		t.Fatal(err)
	}
	fire := func(what string, want store.Fired) {
		t.Helper()
		if _, err := st.Pool().Exec(ctx, "UPDATE hipq_schedule SET last_fire = now() - interval '1 hour' - interval '10 seconds'"); err != nil {
			t.Fatal(err)
		}
		f, err := st.ScheduleFire(ctx, s, types["t"], time.Now().Add(-24*time.Hour))
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if f.Enqueued != want.Enqueued || f.Skipped != want.Skipped {
			t.Fatalf("%s: %d enqueued, %d skipped, want %d and %d", what, f.Enqueued, f.Skipped, want.Enqueued, want.Skipped)
		}
	}
	fire("first tick", store.Fired{Enqueued: 1})
	fire("a tick while its job is waiting", store.Fired{Skipped: 1})
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_job SET state = 'final', outcome = 'cancelled' WHERE job_type = 't'"); err != nil {
		t.Fatal(err)
	}
	fire("a tick once its job ended", store.Fired{Enqueued: 1})
	if n := count(t, st, "SELECT count(*) FROM hipq_job WHERE job_type = 't'"); n != 2 {
		t.Errorf("%d jobs, want 2", n)
	}
}

// A trigger enqueues the schedule's job now, outside its timetable: its
// key's non-final job makes it a duplicate, and last_fire does not move.
func TestScheduleTrigger(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	s := &correlator.Schedule{Name: "m", Cron: "@every 1h", JobType: "t", KeyTemplate: "manual"}
	if err := s.Compile(); err != nil {
		t.Fatal(err)
	}
	if err := st.ScheduleSync(ctx, []string{"m"}); err != nil {
		t.Fatal(err)
	}
	before, _, err := st.ScheduleStates(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []bool{true, false} {
		key, created, err := st.ScheduleTrigger(ctx, s, types["t"])
		if err != nil || key != "manual" || created != want {
			t.Fatalf("trigger #%d: key %q created %v err %v, want manual %v", i+1, key, created, err, want)
		}
	}
	after, _, err := st.ScheduleStates(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !after["m"].LastFire.Equal(before["m"].LastFire) || after["m"].LastJobKey != "manual" {
		t.Errorf("after triggers: %+v, want last_fire %v kept and last job manual", after["m"], before["m"].LastFire)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_job WHERE job_type = 't'"); n != 1 {
		t.Errorf("%d jobs, want 1", n)
	}
	other := *s
	other.Name = "nope"
	if _, _, err := st.ScheduleTrigger(ctx, &other, types["t"]); !errors.Is(err, correlator.ErrNotFound) {
		t.Errorf("trigger of a schedule without a row: %v, want not found", err)
	}
}

package sweeper

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
)

// A paused schedule with ticks due is not a reason to look again at once
// (a spin would hammer PostgreSQL): the loop sleeps until the schedule's
// next tick, when a resume made meanwhile fires it.
func TestPeriodicPausedDoesNotSpin(t *testing.T) {
	st := pgtest.New(t)
	ctx := context.Background()
	s := &correlator.Schedule{Name: "p", Cron: "@every 1s", JobType: "t", KeyTemplate: "k"}
	if err := s.Compile(); err != nil {
		t.Fatal(err)
	}
	p := NewPeriodic(zap.NewNop(), st, []*correlator.Schedule{s}, correlator.Types{"t": {Name: "t", Queue: "default"}}, nil)
	if err := st.ScheduleSync(ctx, []string{"p"}); err != nil {
		t.Fatal(err)
	}
	if err := st.ScheduleSetPaused(ctx, "p", true); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_schedule SET last_fire = now() - interval '1 hour'"); err != nil {
		t.Fatal(err)
	}
	since, synced := time.Time{}, true
	wait, err := p.look(ctx, &since, &synced)
	if err != nil || wait < 50*time.Millisecond || wait > 1100*time.Millisecond {
		t.Errorf("paused with ticks due: wait %v (%v), want until the next tick (at most 1 s)", wait, err)
	}
}

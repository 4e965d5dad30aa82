package correlator

import (
	"strings"
	"testing"
	"time"
)

func berlin(t *testing.T) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation("Europe/Berlin")
	if err != nil {
		t.Skipf("no zone data for Europe/Berlin: %v", err)
	}
	return loc
}

func compiled(t *testing.T, s Schedule) *Schedule {
	t.Helper()
	if s.Name == "" {
		s.Name = "s"
	}
	if s.JobType == "" {
		s.JobType = "report.daily"
	}
	if s.KeyTemplate == "" {
		s.KeyTemplate = `k-{{.Time.Format "2006-01-02T15:04:05Z07:00"}}`
	}
	if err := s.Compile(); err != nil {
		t.Fatal(err)
	}
	return &s
}

func ticks(s *Schedule, from time.Time, n int) []string {
	var out []string
	for t := from; len(out) < n; {
		t = s.Next(t)
		out = append(out, t.In(s.Zone).Format(time.RFC3339))
	}
	return out
}

// A tick in the spring-forward gap fires at the first instant after it;
// a wall time that happens twice fires once, at its first occurrence.
func TestScheduleDaylightSaving(t *testing.T) {
	loc := berlin(t)
	s := compiled(t, Schedule{Cron: "30 2 * * *", Zone: loc})
	got := ticks(s, time.Date(2026, 3, 27, 12, 0, 0, 0, loc), 3)
	want := []string{"2026-03-28T02:30:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("spring: %v, want %v", got, want)
	}
	got = ticks(s, time.Date(2026, 10, 23, 12, 0, 0, 0, loc), 3)
	want = []string{"2026-10-24T02:30:00+02:00", "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("autumn: %v, want %v", got, want)
	}
	// Every 15 minutes through both nights: the gap's ticks fold into one at
	// 03:00, the repeated hour fires once.
	q := compiled(t, Schedule{Cron: "*/15 * * * *", Zone: loc})
	got = ticks(q, time.Date(2026, 3, 29, 1, 40, 0, 0, loc), 4)
	want = []string{"2026-03-29T01:45:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-29T03:15:00+02:00", "2026-03-29T03:30:00+02:00"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("spring, every 15 min: %v, want %v", got, want)
	}
	got = ticks(q, time.Date(2026, 10, 25, 1, 40, 0, 0, loc), 10)
	seen := map[string]bool{}
	for _, g := range got {
		wall := g[:19]
		if seen[wall] {
			t.Errorf("autumn, every 15 min: wall time %s fires twice: %v", wall, got)
		}
		seen[wall] = true
	}
	if got[len(got)-1] != "2026-10-25T04:00:00+01:00" {
		t.Errorf("autumn, every 15 min: %v", got)
	}
	// From inside the repeated hour's second pass, the next tick is after it.
	second := time.Date(2026, 10, 25, 0, 40, 0, 0, time.UTC) // 01:40 UTC = 02:40 CET, the second 02:40
	if n := q.Next(second.Add(time.Hour)); !n.After(second.Add(time.Hour)) {
		t.Errorf("Next went back: %v", n)
	}
	// @every is a constant delay whatever the zone.
	e := compiled(t, Schedule{Cron: "@every 1h", Zone: loc})
	from := time.Date(2026, 10, 25, 0, 0, 0, 0, time.UTC)
	if n := e.Next(from); n.Sub(from) != time.Hour {
		t.Errorf("@every 1h: %v", n)
	}
}

func TestScheduleCompileErrors(t *testing.T) {
	for _, c := range []struct {
		s    Schedule
		want string
	}{
		{Schedule{Name: "a", Cron: "61 * * * *", JobType: "t", KeyTemplate: "k"}, "cron"},
		{Schedule{Name: "a", Cron: "CRON_TZ=UTC 0 * * * *", JobType: "t", KeyTemplate: "k"}, "tz"},
		{Schedule{Name: "a", Cron: "@daily", JobType: "t", KeyTemplate: "{{.Nope}}"}, "job_key"},
		{Schedule{Name: "a", Cron: "@daily", JobType: "t", KeyTemplate: "{{.Time"}, "job_key"},
		{Schedule{Name: "a", Cron: "@daily", JobType: "t", KeyTemplate: "{{if false}}x{{end}}"}, "job_key"},
		{Schedule{Name: "a", Cron: "@daily", JobType: "t", KeyTemplate: "k", CatchUp: "some"}, "catch_up"},
		{Schedule{Name: "a", Cron: "@daily", JobType: "t", KeyTemplate: "k", Overlap: "never"}, "overlap"},
	} {
		err := c.s.Compile()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error naming %s", c.s, err, c.want)
		}
	}
}

func TestScheduleRequest(t *testing.T) {
	loc := berlin(t)
	s := compiled(t, Schedule{Cron: "30 2 * * *", Zone: loc, KeyTemplate: `daily-{{.Time.Format "2006-01-02"}}`, JobData: []byte(`{"a":1}`)})
	r, err := s.Request(time.Date(2026, 3, 29, 1, 0, 0, 0, time.UTC))
	if err != nil || r.JobKey != "daily-2026-03-29" || string(r.JobData) != `{"a":1}` || r.JobType != "report.daily" {
		t.Fatalf("%+v %v", r, err)
	}
}

// The catch-up rules: on-time ticks fire; missed ones follow catch_up.
func TestSchedulePlan(t *testing.T) {
	base := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	every := func(c CatchUp) *Schedule {
		return compiled(t, Schedule{Cron: "@every 2s", CatchUp: c, CatchUpWindow: time.Minute})
	}
	// Watching all along: the tick that fell due fires, under every policy.
	for _, c := range []CatchUp{CatchUpLatest, CatchUpNone, CatchUpAll} {
		p := every(c).Plan(base, base.Add(2100*time.Millisecond), base.Add(-time.Hour))
		if len(p.Fire) != 1 || !p.Fire[0].Equal(base.Add(2*time.Second)) || !p.Last.Equal(p.Fire[0]) {
			t.Errorf("%s on time: %+v", c, p)
		}
	}
	// Down for three ticks, the scheduler starts after them.
	now := base.Add(7500 * time.Millisecond)
	for c, n := range map[CatchUp]int{CatchUpLatest: 1, CatchUpNone: 0, CatchUpAll: 3} {
		p := every(c).Plan(base, now, now)
		if len(p.Fire) != n || p.Dropped != 3-n || !p.Last.Equal(base.Add(6*time.Second)) {
			t.Errorf("%s after downtime: %+v, want %d fired", c, p, n)
		}
		if n == 1 && !p.Fire[0].Equal(base.Add(6*time.Second)) {
			t.Errorf("latest fires the latest: %v", p.Fire)
		}
	}
	// An outage while watching: the latest fires, the earlier follow the policy.
	p := every(CatchUpNone).Plan(base, now, base.Add(-time.Hour))
	if len(p.Fire) != 1 || p.Dropped != 2 {
		t.Errorf("outage, none: %+v", p)
	}
	// Ticks older than the window never fire; all fires at most MaxCatchUp.
	p = every(CatchUpAll).Plan(base, base.Add(time.Hour), base.Add(time.Hour))
	if len(p.Fire) != 30 || !p.Fire[0].After(base.Add(59*time.Minute)) {
		t.Errorf("window: %d fired, first %v", len(p.Fire), p.Fire)
	}
	wide := compiled(t, Schedule{Cron: "@every 1s", CatchUp: CatchUpAll})
	if p := wide.Plan(base, base.Add(time.Hour), base.Add(time.Hour)); len(p.Fire) != MaxCatchUp {
		t.Errorf("all is bounded: %d", len(p.Fire))
	}
	// Nothing due: nothing moves.
	if p := every(CatchUpAll).Plan(base, base.Add(time.Second), base); len(p.Fire) != 0 || !p.Last.IsZero() {
		t.Errorf("nothing due: %+v", p)
	}
	// Everything due is older than the window: step past it, fire nothing.
	daily := compiled(t, Schedule{Cron: "0 3 * * *", CatchUp: CatchUpAll, CatchUpWindow: time.Hour})
	p = daily.Plan(base.Add(-72*time.Hour), base, base)
	if len(p.Fire) != 0 || !p.Last.Equal(base.Add(-time.Hour)) {
		t.Errorf("outside the window: %+v", p)
	}
}

// News moves a deadline to now + the heartbeat timeout, never past
// started + max_timeout and never earlier than it was.
func TestExtend(t *testing.T) {
	start := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	jt := &JobType{MaxTimeout: 10 * time.Second}
	cur := start.Add(2 * time.Second)
	for _, c := range []struct {
		jt        *JobType
		now, want time.Time
	}{
		{jt, start.Add(time.Second), start.Add(3 * time.Second)},                                                   // now + timeout
		{jt, start.Add(9 * time.Second), start.Add(10 * time.Second)},                                              // capped
		{&JobType{}, start.Add(time.Second), cur},                                                                  // max_timeout = timeout: no extension
		{&JobType{HeartbeatTimeout: 500 * time.Millisecond, MaxTimeout: time.Minute}, start.Add(time.Second), cur}, // never earlier
		{&JobType{HeartbeatTimeout: 5 * time.Second, MaxTimeout: time.Minute}, start.Add(time.Second), start.Add(6 * time.Second)},
		{nil, start.Add(time.Second), cur},
	} {
		if got := c.jt.Extend(start, 2*time.Second, cur, c.now); !got.Equal(c.want) {
			t.Errorf("%+v at %v: %v, want %v", c.jt, c.now.Sub(start), got.Sub(start), c.want.Sub(start))
		}
	}
}

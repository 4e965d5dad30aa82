package correlator

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"text/template"
	"time"

	"github.com/robfig/cron/v3"
)

// CatchUp is what a schedule does with ticks missed while no instance
// watched it (every instance down, PostgreSQL unreachable).
type CatchUp string

// The catch-up policies.
const (
	CatchUpLatest CatchUp = "latest" // fire the latest missed tick once (default)
	CatchUpNone   CatchUp = "none"   // fire none of them
	CatchUpAll    CatchUp = "all"    // fire each, oldest first, at most MaxCatchUp
)

// Overlap is whether a tick fires while the schedule's last job is not final.
type Overlap string

// The overlap policies.
const (
	OverlapAllow Overlap = "allow" // default
	OverlapSkip  Overlap = "skip"
)

// Schedule defaults and bounds.
const (
	DefaultCatchUpWindow = 24 * time.Hour
	// MaxCatchUp bounds the ticks one catch-up fires.
	MaxCatchUp = 100
	// OnTimeSlack: a tick due this long before the scheduler first looked
	// still counts as on time, so an instance starting as another fires a
	// tick never takes that tick for missed.
	OnTimeSlack = time.Second
)

// Schedule is a periodic job: a cron timetable in a time zone, and the job
// each tick enqueues.
type Schedule struct {
	Name          string
	Cron          string
	Zone          *time.Location
	JobType       string
	KeyTemplate   string
	JobData       json.RawMessage
	CatchUp       CatchUp
	CatchUpWindow time.Duration
	Overlap       Overlap

	spec cron.Schedule
	wall bool // a cron spec, computed in wall-clock time; @every is a constant delay
	key  *template.Template
}

// ScheduleTick is what a key template sees: the tick's time in the
// schedule's zone and the schedule's name.
type ScheduleTick struct {
	Time time.Time
	Name string
}

// Compile parses the cron spec, the zone's use and the key template, and
// checks that a tick's key renders; errors name the field.
func (s *Schedule) Compile() error {
	if strings.HasPrefix(s.Cron, "TZ=") || strings.HasPrefix(s.Cron, "CRON_TZ=") {
		return &FieldError{Field: "cron", Reason: "name the zone in tz, not in the spec"}
	}
	spec, err := cron.ParseStandard(s.Cron)
	if err != nil {
		return &FieldError{Field: "cron", Reason: err.Error()}
	}
	if sp, ok := spec.(*cron.SpecSchedule); ok {
		// Ticks are computed on wall clocks written as UTC, then placed in
		// the zone: the parser's own zone handling would skip a tick in a
		// spring-forward gap and fire a repeated wall time twice.
		sp.Location = time.UTC
		s.wall = true
	}
	s.spec = spec
	if s.Zone == nil {
		s.Zone = time.UTC
	}
	if s.CatchUp == "" {
		s.CatchUp = CatchUpLatest
	}
	switch s.CatchUp {
	case CatchUpLatest, CatchUpNone, CatchUpAll:
	default:
		return &FieldError{Field: "catch_up", Reason: fmt.Sprintf("%q is not one of latest, none, all", s.CatchUp)}
	}
	if s.CatchUpWindow == 0 {
		s.CatchUpWindow = DefaultCatchUpWindow
	}
	if s.CatchUpWindow < 0 {
		return &FieldError{Field: "catch_up_window", Reason: "must be a positive duration"}
	}
	if s.Overlap == "" {
		s.Overlap = OverlapAllow
	}
	if s.Overlap != OverlapAllow && s.Overlap != OverlapSkip {
		return &FieldError{Field: "overlap", Reason: fmt.Sprintf("%q is not one of allow, skip", s.Overlap)}
	}
	if s.KeyTemplate == "" {
		return &FieldError{Field: "job_key", Reason: "is required"}
	}
	s.key, err = template.New(s.Name).Option("missingkey=error").Parse(s.KeyTemplate)
	if err != nil {
		return &FieldError{Field: "job_key", Reason: err.Error()}
	}
	if s.Next(time.Now()).IsZero() {
		return &FieldError{Field: "cron", Reason: "never fires"}
	}
	if _, err := s.Request(s.Next(time.Now())); err != nil {
		return &FieldError{Field: "job_key", Reason: err.(*InputError).Detail}
	}
	return nil
}

// FieldError is a problem with one field of a definition.
type FieldError struct{ Field, Reason string }

func (e *FieldError) Error() string { return e.Field + ": " + e.Reason }

// Request is the job request of the tick at t: the rendered key, the
// schedule's job_data. A key that cannot be rendered or is not a valid
// key is an *InputError naming job_key, like any bad request.
func (s *Schedule) Request(t time.Time) (*Request, error) {
	var b bytes.Buffer
	if err := s.key.Execute(&b, ScheduleTick{Time: t.In(s.Zone), Name: s.Name}); err != nil {
		return nil, &InputError{Code: CodeInvalidField, Field: "job_key", Detail: Clip(err.Error(), MaxDetailBytes)}
	}
	r := &Request{JobType: s.JobType, JobKey: b.String(), JobData: s.JobData}
	if err := r.validate(); err != nil {
		return nil, &InputError{Code: CodeInvalidField, Field: "job_key",
			Detail: Clip(fmt.Sprintf("the key of the tick at %s: %v", t.In(s.Zone).Format(time.RFC3339), err), MaxDetailBytes)}
	}
	return r, nil
}

// Next is the schedule's first tick after t, or zero when there is none.
// A cron tick whose wall time falls in a spring-forward gap fires at the
// first instant after the gap; a wall time that happens twice when clocks
// fall back fires once, at its first occurrence. @every ticks are a
// constant delay apart, whatever the zone.
func (s *Schedule) Next(t time.Time) time.Time {
	if !s.wall {
		return s.spec.Next(t)
	}
	w := wallOf(t.In(s.Zone))
	for range 1000 {
		w = s.spec.Next(w)
		if w.IsZero() {
			return time.Time{}
		}
		if at := placeWall(w, s.Zone); at.After(t) {
			return at
		}
	}
	return time.Time{}
}

// Ticks lists the ticks in (after, upTo], oldest first, keeping the latest
// max of them.
func (s *Schedule) Ticks(after, upTo time.Time, max int) []time.Time {
	var out []time.Time
	for t := s.Next(after); !t.IsZero() && !t.After(upTo); t = s.Next(t) {
		out = append(out, t)
		if len(out) > max {
			out = out[1:]
		}
	}
	return out
}

// wallOf is t's wall clock written as a UTC time.
func wallOf(t time.Time) time.Time {
	y, mo, d := t.Date()
	return time.Date(y, mo, d, t.Hour(), t.Minute(), t.Second(), t.Nanosecond(), time.UTC)
}

// placeWall is the instant at which zone's wall clock reads w (a wall time
// written as UTC): the first of two when it reads it twice, the end of the
// gap when it never does.
func placeWall(w time.Time, zone *time.Location) time.Time {
	c := time.Date(w.Year(), w.Month(), w.Day(), w.Hour(), w.Minute(), w.Second(), w.Nanosecond(), zone)
	var first time.Time
	for _, d := range []time.Duration{-3 * time.Hour, -2 * time.Hour, -90 * time.Minute, -time.Hour, -30 * time.Minute, 0,
		30 * time.Minute, time.Hour, 90 * time.Minute, 2 * time.Hour, 3 * time.Hour} {
		if x := c.Add(d); wallOf(x.In(zone)).Equal(w) && (first.IsZero() || x.Before(first)) {
			first = x
		}
	}
	if !first.IsZero() {
		return first
	}
	// In a gap: the transition, where the wall clock jumps past w.
	start, end := c.ZoneBounds()
	if wallOf(c.In(zone)).After(w) {
		return start
	}
	return end
}

// FirePlan is what one look at a schedule does: the ticks to fire, how many
// missed ticks it drops, and the new last fire time.
type FirePlan struct {
	Fire    []time.Time
	Dropped int
	Last    time.Time
}

// Plan decides, at now, for a schedule last fired at last and watched by
// this scheduler since watchedSince, which due ticks fire. The latest due
// tick fires when it fell due while the scheduler watched; ticks before it
// (more than one due at once: an outage) and ticks due before anyone
// watched are missed, and follow catch_up. Ticks older than the catch-up
// window never fire. Last is the latest due tick (zero: nothing is due).
func (s *Schedule) Plan(last, now, watchedSince time.Time) FirePlan {
	from := last
	if w := now.Add(-s.CatchUpWindow); w.After(from) {
		from = w
	}
	var p FirePlan
	due := s.Ticks(from, now, MaxCatchUp)
	if len(due) == 0 {
		if from.After(last) {
			p.Last = from // ticks due before the window never fire: step past them
		}
		return p
	}
	latest := due[len(due)-1]
	p.Last = latest
	onTime := latest.After(watchedSince.Add(-OnTimeSlack))
	switch {
	case s.CatchUp == CatchUpAll:
		p.Fire = due
	case onTime || s.CatchUp == CatchUpLatest:
		p.Fire = due[len(due)-1:]
	}
	p.Dropped = len(due) - len(p.Fire)
	return p
}

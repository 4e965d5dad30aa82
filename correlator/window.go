package correlator

import (
	"fmt"
	"time"
)

// TimeWindow is a daily [Start, End) span of wall-clock time in a zone.
// Start == End means all day; End before Start crosses midnight.
type TimeWindow struct {
	Start string `json:"start"` // "HH:MM"
	End   string `json:"end"`   // "HH:MM"
	TZ    string `json:"tz"`    // IANA zone; empty means UTC

	start, end int // minutes since midnight, set by Compile
	loc        *time.Location
}

// Compile parses the window's fields; it must be called before NextAllowed.
func (w *TimeWindow) Compile() error {
	var err error
	if w.start, err = parseClock(w.Start); err != nil {
		return fmt.Errorf("start: %w", err)
	}
	if w.end, err = parseClock(w.End); err != nil {
		return fmt.Errorf("end: %w", err)
	}
	tz := w.TZ
	if tz == "" {
		tz = "UTC"
	}
	if w.loc, err = time.LoadLocation(tz); err != nil {
		return fmt.Errorf("tz: unknown time zone %q", w.TZ)
	}
	return nil
}

func parseClock(s string) (int, error) {
	var h, m int
	if len(s) != 5 || s[2] != ':' {
		return 0, fmt.Errorf("%q is not HH:MM", s)
	}
	if _, err := fmt.Sscanf(s, "%02d:%02d", &h, &m); err != nil || h > 23 || m > 59 || h < 0 || m < 0 {
		return 0, fmt.Errorf("%q is not a time of day HH:MM", s)
	}
	return h*60 + m, nil
}

// Contains reports whether t falls inside the window.
func (w *TimeWindow) Contains(t time.Time) bool {
	if w.start == w.end {
		return true
	}
	lt := t.In(w.loc)
	m := lt.Hour()*60 + lt.Minute()
	if w.start < w.end {
		return m >= w.start && m < w.end
	}
	return m >= w.start || m < w.end
}

// nextOpening is the first instant >= t at which the window is open.
func (w *TimeWindow) nextOpening(t time.Time) time.Time {
	if w.Contains(t) {
		return t
	}
	lt := t.In(w.loc)
	y, mo, d := lt.Date()
	for i := 0; i < 3; i++ {
		// time.Date normalizes a wall time inside a DST gap forward.
		open := time.Date(y, mo, d+i, w.start/60, w.start%60, 0, 0, w.loc)
		if lo := open.In(w.loc); lo.Hour()*60+lo.Minute() != w.start {
			day := time.Date(y, mo, d+i, 12, 0, 0, 0, w.loc)
			open = w.afterGap(open, day.Year(), day.Month(), day.Day())
		}
		open = w.firstOccurrence(open, t)
		if !open.Before(t) {
			if !w.Contains(open) {
				// The whole window fell in a daylight-saving gap (02:14-02:34
				// on the night clocks jump from 02:00 to 03:00): it does not
				// open that day.
				continue
			}
			return w.reenteredBefore(t, open)
		}
	}
	return t // unreachable for a compiled window
}

// reenteredBefore returns the first change of the zone's offset in (t,
// open) after which the window is open, else open: when clocks fall back,
// the wall clock can go back into a window without passing its start.
func (w *TimeWindow) reenteredBefore(t, open time.Time) time.Time {
	for at := t; ; {
		_, end := at.In(w.loc).ZoneBounds()
		if end.IsZero() || !end.Before(open) {
			return open
		}
		if w.Contains(end) {
			return end
		}
		at = end
	}
}

// firstOccurrence returns the earliest instant not before t whose wall clock
// is open's: when clocks fall back, a wall time happens twice and time.Date
// may give the second.
func (w *TimeWindow) firstOccurrence(open, t time.Time) time.Time {
	lo := open.In(w.loc)
	for _, back := range []time.Duration{2 * time.Hour, time.Hour, 30 * time.Minute} {
		c := open.Add(-back)
		lc := c.In(w.loc)
		if !c.Before(t) && lc.Year() == lo.Year() && lc.YearDay() == lo.YearDay() &&
			lc.Hour() == lo.Hour() && lc.Minute() == lo.Minute() {
			return c
		}
	}
	return open
}

// afterGap returns the first instant on the local date of day whose wall
// clock reaches the window's start: when the start falls in a daylight-saving
// gap, that is the end of the gap.
func (w *TimeWindow) afterGap(near time.Time, y int, mo time.Month, d int) time.Time {
	probe := near.Add(-3 * time.Hour).Truncate(time.Minute)
	for i := 0; i < 6*60; i++ {
		lo := probe.In(w.loc)
		ly, lm, ld := lo.Date()
		if ly == y && lm == mo && ld == d && lo.Hour()*60+lo.Minute() >= w.start {
			return probe
		}
		probe = probe.Add(time.Minute)
	}
	return near
}

// NextAllowed is the first instant >= t inside any of the windows; with no
// windows it is t.
func NextAllowed(windows []TimeWindow, t time.Time) time.Time {
	if len(windows) == 0 {
		return t
	}
	best := time.Time{}
	for i := range windows {
		n := windows[i].nextOpening(t)
		if best.IsZero() || n.Before(best) {
			best = n
		}
	}
	return best
}

// CompileStored compiles windows read back from storage (checked when the
// job was taken in, so an error means this build cannot evaluate them: a
// zone its time zone data lacks). A window that does not compile is taken
// as open all day, by the claim and by retry scheduling alike, so a job
// is never held back by time zone data this build lacks; the first error
// is returned for the caller to log.
func CompileStored(ws []TimeWindow) error {
	var first error
	for i := range ws {
		if err := ws[i].Compile(); err != nil {
			if first == nil {
				first = fmt.Errorf("time_windows[%d].%w", i, err)
			}
			ws[i].start, ws[i].end, ws[i].loc = 0, 0, time.UTC
		}
	}
	return first
}

// CompileWindows compiles every window, naming the first bad one.
func CompileWindows(ws []TimeWindow) error {
	for i := range ws {
		if err := ws[i].Compile(); err != nil {
			return fmt.Errorf("time_windows[%d].%w", i, err)
		}
	}
	return nil
}

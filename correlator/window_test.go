package correlator

import (
	"math/rand/v2"
	"strings"
	"testing"
	"testing/quick"
	"time"
)

func mustWindows(t testing.TB, ws ...TimeWindow) []TimeWindow {
	t.Helper()
	if err := CompileWindows(ws); err != nil {
		t.Fatal(err)
	}
	return ws
}

func TestNextAllowed(t *testing.T) {
	utc := func(s string) time.Time { v, _ := time.Parse(time.RFC3339, s); return v }
	tests := []struct {
		name    string
		windows []TimeWindow
		at      string
		want    string
	}{
		{"no windows", nil, "2026-03-01T10:00:00Z", "2026-03-01T10:00:00Z"},
		{"inside", []TimeWindow{{Start: "05:00", End: "07:00"}}, "2026-03-01T06:00:00Z", "2026-03-01T06:00:00Z"},
		{"before", []TimeWindow{{Start: "05:00", End: "07:00"}}, "2026-03-01T04:00:00Z", "2026-03-01T05:00:00Z"},
		{"end is excluded", []TimeWindow{{Start: "05:00", End: "07:00"}}, "2026-03-01T07:00:00Z", "2026-03-02T05:00:00Z"},
		{"crosses midnight, late", []TimeWindow{{Start: "22:00", End: "02:00"}}, "2026-03-01T23:30:00Z", "2026-03-01T23:30:00Z"},
		{"crosses midnight, early", []TimeWindow{{Start: "22:00", End: "02:00"}}, "2026-03-01T01:00:00Z", "2026-03-01T01:00:00Z"},
		{"crosses midnight, outside", []TimeWindow{{Start: "22:00", End: "02:00"}}, "2026-03-01T12:00:00Z", "2026-03-01T22:00:00Z"},
		{"all day", []TimeWindow{{Start: "09:00", End: "09:00"}}, "2026-03-01T03:00:00Z", "2026-03-01T03:00:00Z"},
		{"earliest of two", []TimeWindow{{Start: "20:00", End: "21:00"}, {Start: "13:00", End: "14:00"}}, "2026-03-01T12:00:00Z", "2026-03-01T13:00:00Z"},
		{"zone", []TimeWindow{{Start: "05:00", End: "07:00", TZ: "Europe/Berlin"}}, "2026-01-10T12:00:00Z", "2026-01-11T04:00:00Z"},
		// Berlin springs forward 2026-03-29 02:00 → 03:00: a 02:30 start moves to 03:00 CEST (01:00 UTC).
		{"DST gap", []TimeWindow{{Start: "02:30", End: "04:00", TZ: "Europe/Berlin"}}, "2026-03-28T23:00:00Z", "2026-03-29T01:00:00Z"},
		// Berlin falls back 2026-10-25 03:00 → 02:00: 02:30 happens twice; the first counts.
		{"DST repeat", []TimeWindow{{Start: "02:30", End: "04:00", TZ: "Europe/Berlin"}}, "2026-10-24T23:00:00Z", "2026-10-25T00:30:00Z"},
		{"DST gap, crosses midnight", []TimeWindow{{Start: "02:15", End: "01:00", TZ: "America/New_York"}}, "2026-03-08T06:30:00Z", "2026-03-08T07:00:00Z"},
		{"New York on a DST day", []TimeWindow{{Start: "09:00", End: "17:00", TZ: "America/New_York"}}, "2026-03-08T12:00:00Z", "2026-03-08T13:00:00Z"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := NextAllowed(mustWindows(t, tt.windows...), utc(tt.at))
			if !got.Equal(utc(tt.want)) {
				t.Errorf("got %v, want %s", got.UTC(), tt.want)
			}
		})
	}
}

// TestNextAllowedProperties: for random windows and instants the result is
// never before the instant, always inside a window, and no later than the
// first opening within the next two days.
func TestNextAllowedProperties(t *testing.T) {
	zones := []string{"UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata"}
	clock := func(m int) string { return time.Date(2000, 1, 1, m/60, m%60, 0, 0, time.UTC).Format("15:04") }
	prop := func(seed uint64) bool {
		r := rand.New(rand.NewPCG(seed, 7))
		n := 1 + r.IntN(3)
		ws := make([]TimeWindow, n)
		for i := range ws {
			ws[i] = TimeWindow{Start: clock(r.IntN(1440)), End: clock(r.IntN(1440)), TZ: zones[r.IntN(len(zones))]}
		}
		if err := CompileWindows(ws); err != nil {
			t.Fatal(err)
		}
		at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).Add(time.Duration(r.Int64N(int64(365 * 24 * time.Hour))))
		got := NextAllowed(ws, at)
		if got.Before(at) || got.After(at.Add(49*time.Hour)) {
			t.Logf("windows %+v at %v: got %v", ws, at, got)
			return false
		}
		inside := false
		for i := range ws {
			inside = inside || ws[i].Contains(got)
		}
		if !inside {
			t.Logf("windows %+v at %v: %v is outside every window", ws, at, got)
		}
		return inside
	}
	if err := quick.Check(prop, &quick.Config{MaxCount: 5000}); err != nil {
		t.Fatal(err)
	}
}

// Never backwards: a later instant never gets an earlier opening, and no
// minute between the instant and its opening is inside a window (the
// opening is the first one).
func TestNextAllowedMonotonicAndFirst(t *testing.T) {
	zones := []string{"UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata"}
	clock := func(m int) string { return time.Date(2000, 1, 1, m/60, m%60, 0, 0, time.UTC).Format("15:04") }
	prop := func(seed uint64) bool {
		r := rand.New(rand.NewPCG(seed, 9))
		ws := make([]TimeWindow, 1+r.IntN(2))
		for i := range ws {
			ws[i] = TimeWindow{Start: clock(r.IntN(1440)), End: clock(r.IntN(1440)), TZ: zones[r.IntN(len(zones))]}
		}
		if err := CompileWindows(ws); err != nil {
			t.Fatal(err)
		}
		// Around the 2026 DST changes of both hemispheres, or anywhere.
		starts := []time.Time{time.Date(2026, 3, 28, 0, 0, 0, 0, time.UTC), time.Date(2026, 10, 24, 0, 0, 0, 0, time.UTC),
			time.Date(2026, 4, 4, 0, 0, 0, 0, time.UTC), time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
		t1 := starts[r.IntN(len(starts))].Add(time.Duration(r.Int64N(int64(72 * time.Hour))))
		t2 := t1.Add(time.Duration(r.Int64N(int64(6 * time.Hour))))
		n1, n2 := NextAllowed(ws, t1), NextAllowed(ws, t2)
		if n2.Before(n1) {
			t.Logf("windows %+v: NextAllowed(%v) = %v but NextAllowed(%v) = %v", ws, t1, n1, t2, n2)
			return false
		}
		inside := func(x time.Time) bool {
			for i := range ws {
				if ws[i].Contains(x) {
					return true
				}
			}
			return false
		}
		for m := t1.Truncate(time.Minute).Add(time.Minute); m.Before(n1); m = m.Add(time.Minute) {
			if inside(m) {
				t.Logf("windows %+v at %v: opening %v, but %v was already inside", ws, t1, n1, m)
				return false
			}
		}
		return true
	}
	if err := quick.Check(prop, &quick.Config{MaxCount: 1500}); err != nil {
		t.Fatal(err)
	}
}

// Windows read back from storage that this build cannot evaluate are open
// all day, as PostgreSQL's claim takes them; the error says why.
func TestCompileStoredOpensWhatItCannotRead(t *testing.T) {
	ws := []TimeWindow{{Start: "05:00", End: "06:00", TZ: "Mars/Olympus_Mons"}}
	if err := CompileStored(ws); err == nil || !strings.Contains(err.Error(), "Mars/Olympus_Mons") {
		t.Fatalf("error %v", err)
	}
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	if got := NextAllowed(ws, now); !got.Equal(now) {
		t.Fatalf("next allowed %v, want now (open)", got)
	}
}

// Found by the property above: when clocks fall back, the wall clock goes
// back into a window without passing its start (Lord Howe Island goes
// back 30 minutes at 02:00 on 2026-04-05, into 01:30-01:44 again).
func TestNextAllowedReentersOnFallBack(t *testing.T) {
	ws := []TimeWindow{{Start: "13:42", End: "01:44", TZ: "Australia/Lord_Howe"}}
	if err := CompileWindows(ws); err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 4, 4, 14, 50, 59, 0, time.UTC) // 01:50:59 +11, outside
	want := time.Date(2026, 4, 4, 15, 0, 0, 0, time.UTC) // 01:30 +10:30, inside again
	if got := NextAllowed(ws, at); !got.Equal(want) {
		t.Fatalf("NextAllowed(%v) = %v, want %v", at, got, want)
	}
}

// A window wholly inside a daylight-saving gap does not open that day: the
// next opening is the next day's, never the gap's end, where the window is
// closed (found by TestNextAllowedProperties).
func TestWindowInsideTheGap(t *testing.T) {
	ws := []TimeWindow{{Start: "02:14", End: "02:34", TZ: "Europe/Berlin"}}
	if err := CompileWindows(ws); err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 3, 28, 12, 21, 39, 0, time.UTC)
	got := NextAllowed(ws, at)
	berlin, _ := time.LoadLocation("Europe/Berlin")
	if want := time.Date(2026, 3, 30, 2, 14, 0, 0, berlin); !got.Equal(want) || !ws[0].Contains(got) {
		t.Fatalf("next opening %v, want %v", got, want)
	}
}

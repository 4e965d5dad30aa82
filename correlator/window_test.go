package correlator

import (
	"math/rand/v2"
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

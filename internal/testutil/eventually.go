// Package testutil holds what the tests of several packages share and no
// product code uses.
package testutil

import (
	"fmt"
	"testing"
	"time"
)

// Interval is how often Eventually checks its condition.
const Interval = 20 * time.Millisecond

// Cond is a condition Eventually polls: whether it holds, and in the second
// form also a note on what was seen, which the failure shows from the last
// check (a count, a state, an error).
type Cond interface {
	func() bool | func() (bool, string)
}

// Eventually checks cond every Interval until it holds, and fails t with
// the message (format and args, naming what was waited for) once within has
// passed without it. cond runs on the test's goroutine, so it may call
// t.Fatal itself.
func Eventually[C Cond](t testing.TB, within time.Duration, cond C, format string, args ...any) {
	t.Helper()
	check := func() (bool, string) {
		if c, ok := any(cond).(func() bool); ok {
			return c(), ""
		}
		return any(cond).(func() (bool, string))()
	}
	deadline := time.Now().Add(within)
	for {
		ok, note := check()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			what := fmt.Sprintf(format, args...)
			if note != "" {
				t.Fatalf("waited %v for %s (last: %s)", within, what, note)
			}
			t.Fatalf("waited %v for %s", within, what)
			return
		}
		time.Sleep(Interval)
	}
}

package testutil

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fatalTB records Fatalf and ends the calling goroutine, as testing's does.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// run calls Eventually as a test would, on a goroutine of its own, and
// returns the failure message ("" when it returned).
func run(t *testing.T, do func(tb testing.TB)) string {
	t.Helper()
	f := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() { defer close(done); do(f) }()
	<-done
	return f.msg
}

func TestEventually(t *testing.T) {
	n := 0
	if msg := run(t, func(tb testing.TB) {
		Eventually(tb, time.Minute, func() bool { n++; return n == 3 }, "the third check")
	}); msg != "" || n != 3 {
		t.Fatalf("a condition that comes to hold: %q after %d checks", msg, n)
	}
	start := time.Now()
	msg := run(t, func(tb testing.TB) {
		Eventually(tb, 50*time.Millisecond, func() (bool, string) { return false, "seen 7" }, "job %d", 42)
	})
	if msg != "waited 50ms for job 42 (last: seen 7)" {
		t.Fatalf("a condition that never holds: %q", msg)
	}
	if took := time.Since(start); took < 50*time.Millisecond {
		t.Fatalf("failed after %v, before the deadline", took)
	}
	if msg := run(t, func(tb testing.TB) {
		Eventually(tb, 0, func() bool { return false }, "nothing")
	}); msg != "waited 0s for nothing" {
		t.Fatalf("without a note: %q", msg)
	}
}

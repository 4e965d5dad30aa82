package memlimit

import (
	"os"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// A release takes the binary's pages out of the resident set, and the
// code that runs next is mapped again; under a limit the binary is a
// small share of, nothing is released.
func TestReleaseBinaryPages(t *testing.T) {
	before := Outside("/")
	if before == 0 {
		t.Skip("no RssFile in /proc/self/status")
	}
	if n := ReleaseBinaryPages(2 * before * ReleaseWhenOver); n != 0 {
		t.Errorf("released %d bytes under a limit %d times the binary's pages, want none", n, ReleaseWhenOver)
	}
	start := time.Now()
	n := ReleaseBinaryPages(Min)
	took := time.Since(start)
	after := Outside("/")
	t.Logf("released %s in %v; file-backed resident %s before, %s after", Format(n), took, Format(before), Format(after))
	if n == 0 || after >= before {
		t.Fatalf("released %d bytes; resident outside the runtime %d before, %d after: want fewer after", n, before, after)
	}
	// Code and tables are mapped again as they run.
	if got := Format(3 * MiB); got != "3MiB" {
		t.Fatalf("Format after a release: %q", got)
	}
}

// canary is read-only data of the binary that TestReleaseKeepsPatchedPages
// writes to, as a debugger writes a breakpoint into code.
var canary = "hipq memlimit canary: read-only data of the binary, patched in place by a test"

// A page of the binary the process wrote to (a private copy, as a
// breakpoint, a uprobe or a relocation makes) is not released: its
// content stays what was written, not the file's.
func TestReleaseKeepsPatchedPages(t *testing.T) {
	p := unsafe.Pointer(unsafe.StringData(canary))
	page := uintptr(os.Getpagesize())
	start := uintptr(p) &^ (page - 1)
	mprotect := func(prot uintptr) {
		t.Helper()
		if _, _, errno := syscall.Syscall(syscall.SYS_MPROTECT, start, page, prot); errno != 0 {
			t.Fatalf("mprotect: %v", errno)
		}
	}
	mprotect(syscall.PROT_READ | syscall.PROT_WRITE)
	*(*byte)(p) = 'H'
	mprotect(syscall.PROT_READ)
	if ReleaseBinaryPages(Min) == 0 {
		t.Fatal("nothing released")
	}
	if canary[0] != 'H' {
		t.Fatalf("the patched page was released: the canary reads %q again", canary[:4])
	}
}

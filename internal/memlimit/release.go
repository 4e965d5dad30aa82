package memlimit

import (
	"bufio"
	"encoding/binary"
	"io"
	"os"
	"reflect"
	"strconv"
	"strings"
)

// span is a range of the process's address space, [start, end).
type span struct{ start, end uintptr }

// ReleaseWhenOver is the share of the limit the binary's resident pages
// must pass for ReleaseBinaryPages to release them: under a limit of a
// GiB or more they are a few percent of it, not worth a release.
const ReleaseWhenOver = 16 // (a sixteenth)

// ReleaseBinaryPages gives back the resident pages of the process's own
// binary (its code and read-only tables, mapped from the file) when they
// are more than a sixteenth of limit: the kernel unmaps them, and the
// pages that run again are mapped again from the page cache at their next
// touch. A process touches most of its binary once (every package's
// initialization, code run once) and a fraction of it from then on; the
// pages it keeps between two releases are the ones in use, and the
// runtime's share (Apply) counts only those. It returns the bytes
// released, 0 where nothing was (not Linux, no /proc, the limit not
// tight, the process traced).
//
// Only pages that are resident and are the file's own (pagemap's present
// and file bits) are released, each run of them with one madvise: a page
// the process holds a private copy of (a relocation of a position
// independent binary, a debugger's breakpoint, a uprobe) is anonymous, as
// is one swapped out, and a release would drop it and what was written to
// it. A process under ptrace (TracerPid) releases nothing: its debugger
// may patch a page between the read of pagemap and the release.
func ReleaseBinaryPages(limit int64) int64 {
	file, traced := selfStatus()
	if traced || file <= limit/ReleaseWhenOver {
		return 0
	}
	maps, err := os.Open("/proc/self/maps")
	if err != nil {
		return 0
	}
	spans := binarySpans(maps, reflect.ValueOf(ReleaseBinaryPages).Pointer())
	maps.Close()
	pm, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return 0
	}
	defer pm.Close()
	var n int64
	for _, s := range spans {
		// Read and release one mapping at a time: the window in which a
		// page could be patched after its read is one mapping's.
		for _, r := range fileRuns(pm, s, uintptr(os.Getpagesize())) {
			if release(r) {
				n += int64(r.end - r.start)
			}
		}
	}
	return n
}

// selfStatus reads the process's file-backed resident bytes (RssFile) and
// whether it is traced (TracerPid not 0) from /proc/self/status.
func selfStatus() (file int64, traced bool) {
	st := readStatus("/")
	return st.file, st.traced
}

// binarySpans reads maps and returns the mappings of the binary, the file
// whose mapping holds pc (the binary's own code), that are private and not
// writable. The binary is known by the device and inode maps gives its
// code's mapping, not by a stat of /proc/self/exe, whose device and inode
// differ from the mapped file's on an overlay filesystem (a container's).
func binarySpans(r io.Reader, pc uintptr) []span {
	type mapping struct {
		span
		private, writable bool
		file              string // device and inode, as maps writes them
	}
	var all []mapping
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		// start-end perms offset dev inode [path]
		f := strings.Fields(sc.Text())
		if len(f) < 5 || len(f[1]) != 4 {
			continue
		}
		lo, hi, found := strings.Cut(f[0], "-")
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if !found || err1 != nil || err2 != nil || end <= start {
			continue
		}
		all = append(all, mapping{span: span{uintptr(start), uintptr(end)}, private: f[1][3] == 'p',
			writable: f[1][1] == 'w', file: f[3] + " " + f[4]})
	}
	var binary string
	for _, m := range all {
		if m.start <= pc && pc < m.end && !strings.HasSuffix(m.file, " 0") {
			binary = m.file
		}
	}
	if binary == "" {
		return nil
	}
	var spans []span
	for _, m := range all {
		if m.file == binary && m.private && !m.writable {
			spans = append(spans, m.span)
		}
	}
	return spans
}

// Bits of a pagemap entry (the kernel's admin-guide/mm/pagemap): the page
// is present in memory, and it is a page of the file (or shared), not an
// anonymous one. Both are given to unprivileged readers.
const (
	pagePresent = 1 << 63
	pageFile    = 1 << 61
)

// fileRuns reads pagemap for s and returns its runs of pages that are
// present and the file's own; none when pagemap cannot be read.
func fileRuns(pagemap io.ReaderAt, s span, page uintptr) []span {
	pages := int((s.end - s.start) / page)
	buf := make([]byte, 8*pages)
	if n, err := pagemap.ReadAt(buf, int64(s.start/page)*8); n != len(buf) {
		_ = err // (short or failed: release nothing of s)
		return nil
	}
	var runs []span
	open := false
	for i := range pages {
		e := binary.NativeEndian.Uint64(buf[8*i:])
		at := s.start + uintptr(i)*page
		switch ok := e&pagePresent != 0 && e&pageFile != 0; {
		case ok && open:
			runs[len(runs)-1].end = at + page
		case ok:
			runs, open = append(runs, span{at, at + page}), true
		default:
			open = false
		}
	}
	return runs
}

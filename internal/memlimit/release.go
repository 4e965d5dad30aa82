package memlimit

import (
	"bufio"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
)

// span is a range of the process's address space, [start, end).
type span struct{ start, end uintptr }

// ReleaseBinaryPages gives back the resident pages of the process's own
// binary (its code and read-only tables, mapped from the file): the
// kernel unmaps them, and the pages that run again are mapped again from
// the page cache at their next touch. A process touches most of its binary
// once (every package's initialization, code run once) and a fraction of
// it from then on; the pages it keeps between two releases are the ones in
// use, and the runtime's share (Apply) counts only those. It returns the
// size of the mappings released, 0 where nothing can be released (not
// Linux, no /proc under root).
//
// Only mappings of the binary that are not writable and hold no page of
// their own (smaps' Anonymous: 0) are released: a page a debugger or a
// uprobe patched is a private copy, which a release would drop, and the
// patch with it.
func ReleaseBinaryPages(root string) int64 {
	f, err := os.Open(filepath.Join(root, "proc/self/smaps"))
	if err != nil {
		return 0
	}
	spans := binarySpans(f, reflect.ValueOf(ReleaseBinaryPages).Pointer())
	f.Close()
	var n int64
	for _, s := range spans {
		if release(s) {
			n += int64(s.end - s.start)
		}
	}
	return n
}

// mapping is one entry of smaps.
type mapping struct {
	span
	writable   bool
	file       string // device and inode, as smaps writes them
	rss, anon  int64
	anonListed bool
}

// binarySpans reads smaps and returns the mappings of the binary, the
// file whose mapping holds pc (the binary's own code): those that are not
// writable, have pages resident and hold no anonymous (private, copied)
// page. The binary is known by the device and inode smaps gives its code's
// mapping, not by a stat of /proc/self/exe, whose device and inode differ
// from the mapped file's on an overlay filesystem (a container's).
func binarySpans(r io.Reader, pc uintptr) []span {
	var all []mapping
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if k, v, isField := smapsField(line); isField {
			if len(all) == 0 {
				continue
			}
			m := &all[len(all)-1]
			switch k {
			case "Rss":
				m.rss = v
			case "Anonymous":
				m.anon, m.anonListed = v, true
			}
			continue
		}
		// A mapping's header: start-end perms offset dev inode [path].
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		lo, hi, found := strings.Cut(f[0], "-")
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if !found || err1 != nil || err2 != nil || end <= start {
			continue
		}
		all = append(all, mapping{span: span{uintptr(start), uintptr(end)}, writable: strings.Contains(f[1], "w"), file: f[3] + " " + f[4]})
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
		if m.file == binary && !m.writable && m.rss > 0 && m.anonListed && m.anon == 0 {
			spans = append(spans, m.span)
		}
	}
	return spans
}

// smapsField parses a field line of smaps ("Rss:   120 kB"), in bytes.
func smapsField(line string) (string, int64, bool) {
	k, v, found := strings.Cut(line, ":")
	if !found || strings.ContainsAny(k, " -") {
		return "", 0, false
	}
	v = strings.TrimSpace(v)
	kb, isKB := strings.CutSuffix(v, " kB")
	n, err := strconv.ParseInt(kb, 10, 64)
	if err != nil {
		return k, 0, true
	}
	if isKB {
		n *= KiB
	}
	return k, n, true
}

package memlimit

import (
	"bufio"
	"context"
	"os"
	"path/filepath"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"strings"
	"time"
)

// RuntimeShare is the Go runtime's soft limit within limit: the limit
// less the pages the process has resident outside the runtime's memory
// (outside), at least half of the limit. The runtime's limit counts only
// the memory it maps itself (heap, stacks, its own metadata); the
// process's resident set also holds the pages of its binary mapped from
// the file (its code and tables, some tens of MiB as they are first
// used), which a limit on the process covers too.
func RuntimeShare(limit, outside int64) int64 {
	return max(limit-outside, limit/2)
}

// Outside is the process's resident pages that the Go runtime does not
// count: file-backed (the binary's) and shared memory, from
// proc/self/status under root; 0 when it cannot be read (not Linux).
func Outside(root string) int64 {
	st := readStatus(root)
	return st.file + st.shmem
}

// procStatus is what hipq reads of proc/self/status.
type procStatus struct {
	file, shmem int64 // RssFile, RssShmem in bytes
	traced      bool  // TracerPid not 0
}

// readStatus reads proc/self/status under root; zero when it cannot be
// read (not Linux).
func readStatus(root string) procStatus {
	var st procStatus
	f, err := os.Open(filepath.Join(root, "proc/self/status"))
	if err != nil {
		return st
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		kb, _ := strconv.ParseInt(strings.TrimSuffix(v, " kB"), 10, 64)
		switch k {
		case "RssFile":
			st.file = kb * KiB
		case "RssShmem":
			st.shmem = kb * KiB
		case "TracerPid":
			st.traced = v != "0"
		}
	}
	return st
}

// Apply sets the Go runtime's soft limit to its share of limit
// (RuntimeShare) and returns it.
func Apply(limit int64, root string) int64 {
	share := RuntimeShare(limit, Outside(root))
	debug.SetMemoryLimit(share)
	return share
}

// Keep applies limit again every interval until ctx ends, and releases
// the binary's resident pages after each (ReleaseBinaryPages): the share
// follows the pages the binary keeps resident, those in use.
func Keep(ctx context.Context, limit int64, root string, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			Apply(limit, root)
			ReleaseBinaryPages(limit)
		}
	}
}

// GCPercent is the collector's pace (GOGC) under a memory limit: the heap
// may grow to five times its live objects between two collections, and
// the soft limit (Apply) bounds it first. At the runtime's own 100, a
// process with a few MiB live between bursts collects every few
// milliseconds at a steady load, though the limit leaves it room.
const GCPercent = 400

// ApplyGCPercent sets the collector's pace to GCPercent, unless GOGC is
// set in env (the runtime read it at start: it stands), and returns the
// pace in effect (-1: off).
func ApplyGCPercent(env Env) int {
	if v, ok := env.Lookup("GOGC"); ok && v != "" {
		s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
		metrics.Read(s)
		if s[0].Value.Kind() != metrics.KindUint64 {
			return -1
		}
		if p := s[0].Value.Uint64(); p <= 1<<30 { // (off reads as the largest uint64)
			return int(p)
		}
		return -1
	}
	debug.SetGCPercent(GCPercent)
	return GCPercent
}

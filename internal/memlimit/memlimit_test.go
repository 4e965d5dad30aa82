package memlimit

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"reflect"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/testutil"
)

// fakeRoot writes files (path → content) under a test's directory, as a
// root for Env.
func fakeRoot(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for name, text := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func env(root string, vars map[string]string) Env {
	return Env{Root: root, Lookup: func(k string) (string, bool) { v, ok := vars[k]; return v, ok }}
}

// memory_limit, else GOMEMLIMIT, else 90% of the cgroup's limit, else
// the default; an explicit limit above 90% of the cgroup's is lowered to it.
func TestResolveOrder(t *testing.T) {
	t.Parallel()
	v2 := fakeRoot(t, map[string]string{"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "1073741824\n"}) // 1 GiB
	none := fakeRoot(t, map[string]string{"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "max\n"})
	const cgroup90 = 1073741824 / 100 * 90
	for _, c := range []struct {
		name       string
		configured int64
		env        Env
		want       int64
		from       Source
		asked      int64
	}{
		{"config", 128 * MiB, env(v2, map[string]string{"GOMEMLIMIT": "256MiB"}), 128 * MiB, FromConfig, 0},
		{"GOMEMLIMIT", 0, env(v2, map[string]string{"GOMEMLIMIT": "256MiB"}), 256 * MiB, FromEnv, 0},
		{"GOMEMLIMIT=off is not set", 0, env(v2, map[string]string{"GOMEMLIMIT": "off"}), cgroup90, FromCgroup, 0},
		{"cgroup", 0, env(v2, nil), cgroup90, FromCgroup, 0},
		{"default", 0, env(none, nil), Default, FromDefault, 0},
		{"no cgroup files", 0, env(t.TempDir(), nil), Default, FromDefault, 0},
		{"config above the cgroup's 90%", 2 * GiB, env(v2, nil), cgroup90, FromConfig, 2 * GiB},
		{"GOMEMLIMIT above the cgroup's 90%", 0, env(v2, map[string]string{"GOMEMLIMIT": "1GiB"}), cgroup90, FromEnv, GiB},
		{"config without a cgroup", 2 * GiB, env(none, nil), 2 * GiB, FromConfig, 0},
	} {
		l, err := Resolve(c.configured, c.env)
		if err != nil || l.Bytes != c.want || l.From != c.from || l.Asked != c.asked {
			t.Errorf("%s: %+v, %v; want %d from %s (asked %d)", c.name, l, err, c.want, c.from, c.asked)
		}
	}
	l, _ := Resolve(0, env(v2, nil))
	if l.Cgroup != GiB || l.CgroupFile != "/sys/fs/cgroup/memory.max" || !strings.Contains(l.Origin(), "/sys/fs/cgroup/memory.max") {
		t.Errorf("the cgroup's limit and file: %+v, %q", l, l.Origin())
	}
}

// A bad GOMEMLIMIT is an error naming it and why.
func TestResolveBadGOMEMLIMIT(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]string{"64MB": "not a size in Go's syntax", "lots": "not a size", "24MiB": "below hipq's minimum of 32MiB"} {
		_, err := Resolve(0, env(t.TempDir(), map[string]string{"GOMEMLIMIT": v}))
		if err == nil || !strings.HasPrefix(err.Error(), "GOMEMLIMIT: ") || !strings.Contains(err.Error(), want) {
			t.Errorf("GOMEMLIMIT=%s: %v, want an error saying %q", v, err, want)
		}
	}
}

// The cgroup's limit is read from the process's own cgroup and every one
// above it (the smallest wins), in v2 or v1; "max" and v1's huge number
// are no limit, and a cgroup path that is not there (a host path seen
// from a container) falls back to the root.
func TestCgroupLimit(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		files map[string]string
		want  int64
		file  string
	}{
		{"v2 in a namespace", map[string]string{"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "268435456\n"},
			256 * MiB, "/sys/fs/cgroup/memory.max"},
		{"v2 max", map[string]string{"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "max\n"}, 0, ""},
		{"v2 systemd unit", map[string]string{"proc/self/cgroup": "0::/system.slice/hipq.service\n",
			"sys/fs/cgroup/memory.max":                               "max\n",
			"sys/fs/cgroup/system.slice/memory.max":                  "1073741824\n",
			"sys/fs/cgroup/system.slice/hipq.service/memory.max":     "536870912\n",
			"sys/fs/cgroup/system.slice/hipq.service/memory.current": "1\n"},
			512 * MiB, "/sys/fs/cgroup/system.slice/hipq.service/memory.max"},
		{"v2 parent smaller", map[string]string{"proc/self/cgroup": "0::/a/b\n",
			"sys/fs/cgroup/a/memory.max": "134217728\n", "sys/fs/cgroup/a/b/memory.max": "max\n"},
			128 * MiB, "/sys/fs/cgroup/a/memory.max"},
		{"v1 in a container", map[string]string{"proc/self/cgroup": "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n",
			"sys/fs/cgroup/memory/memory.limit_in_bytes": "201326592\n"},
			192 * MiB, "/sys/fs/cgroup/memory/memory.limit_in_bytes"},
		{"v1 unlimited", map[string]string{"proc/self/cgroup": "4:memory:/\n",
			"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"}, 0, ""},
		{"v1 joint controllers", map[string]string{"proc/self/cgroup": "4:cpu,memory:/x\n",
			"sys/fs/cgroup/memory/x/memory.limit_in_bytes": "100663296\n"},
			96 * MiB, "/sys/fs/cgroup/memory/x/memory.limit_in_bytes"},
		{"no /proc/self/cgroup", map[string]string{"sys/fs/cgroup/memory.max": "67108864"}, 64 * MiB, "/sys/fs/cgroup/memory.max"},
		{"garbage", map[string]string{"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "lots\n"}, 0, ""},
	} {
		n, file := cgroupLimit(fakeRoot(t, c.files))
		if n != c.want || file != c.file {
			t.Errorf("%s: %d from %q, want %d from %q", c.name, n, file, c.want, c.file)
		}
	}
}

func TestParseSize(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]int64{"64MiB": 64 * MiB, "512MB": 512e6, "1GiB": GiB, "67108864": 64 * MiB,
		"1.5GiB": 3 * GiB / 2, "64 MiB": 64 * MiB, "100KiB": 100 * KiB, "2GB": 2e9, "1TiB": 1 << 40, "10B": 10} {
		if n, err := ParseSize(s); err != nil || n != want {
			t.Errorf("%q: %d, %v; want %d", s, n, err, want)
		}
	}
	for _, s := range []string{"", "MiB", "64mb", "-1MiB", "1..5GiB", "64 MiBs", "9999999TiB"} {
		if n, err := ParseSize(s); err == nil {
			t.Errorf("%q: %d, want an error", s, n)
		}
	}
}

func TestParseGoMemLimit(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]int64{"64MiB": 64 * MiB, "1048576": MiB, "1GiB": GiB, "100B": 100, "2TiB": 2 << 40} {
		if n, err := ParseGoMemLimit(s); err != nil || n != want {
			t.Errorf("%q: %d, %v; want %d", s, n, err, want)
		}
	}
	for _, s := range []string{"", "64MB", "1.5GiB", "64 MiB", "-1", "off", "9999999999TiB"} {
		if n, err := ParseGoMemLimit(s); err == nil {
			t.Errorf("%q: %d, want an error", s, n)
		}
	}
}

func TestFormat(t *testing.T) {
	t.Parallel()
	for n, want := range map[int64]string{64 * MiB: "64MiB", GiB: "1GiB", 256 * KiB: "256KiB", 60397977: "57.6MiB", 0: "0"} {
		if got := Format(n); got != want {
			t.Errorf("%d: %q, want %q", n, got, want)
		}
	}
}

// The split: a quarter of the limit for the two groups' fetches at eight
// decoded bytes per fetched byte, an eighth for the producers' buffers, a
// quarter (8 MiB to 1 GiB) for one batch decompressed.
func TestSplitOf(t *testing.T) {
	t.Parallel()
	for limit, want := range map[int64]Split{
		Default:  {FetchMaxBytes: 256 * KiB, FetchMaxPartitionBytes: 256 * KiB, MaxConcurrentFetches: 4, ProducerBytes: 8 * MiB, MaxDecompressBatchBytes: 16 * MiB},
		Min:      {FetchMaxBytes: 128 * KiB, FetchMaxPartitionBytes: 128 * KiB, MaxConcurrentFetches: 4, ProducerBytes: 4 * MiB, MaxDecompressBatchBytes: 8 * MiB},
		GiB:      {FetchMaxBytes: 4 * MiB, FetchMaxPartitionBytes: MiB, MaxConcurrentFetches: 4, ProducerBytes: 128 * MiB, MaxDecompressBatchBytes: 256 * MiB},
		64 * GiB: {FetchMaxBytes: 50 * MiB, FetchMaxPartitionBytes: MiB, MaxConcurrentFetches: 4, ProducerBytes: 8 * GiB, MaxDecompressBatchBytes: GiB},
		4 * MiB:  {FetchMaxBytes: 64 * KiB, FetchMaxPartitionBytes: 64 * KiB, MaxConcurrentFetches: 4, ProducerBytes: 512 * KiB, MaxDecompressBatchBytes: 8 * MiB},
	} {
		if got := SplitOf(limit); got != want {
			t.Errorf("%s: %+v, want %+v", Format(limit), got, want)
		}
	}
	for _, limit := range []int64{Min, Default, 100 * MiB, GiB, 8 * GiB} {
		s := SplitOf(limit)
		if fetched := int64(2*s.MaxConcurrentFetches) * int64(s.FetchMaxBytes) * 8; fetched > limit/4 {
			t.Errorf("%s: the groups' fetches decoded take %d, more than a quarter of the limit", Format(limit), fetched)
		}
	}
	s := SplitOf(Default)
	if got := s.ProducerBufferedBytes(4, 1000012); got != 2*MiB {
		t.Errorf("four clients at 64MiB: %d each, want 2MiB", got)
	}
	if got := SplitOf(Min).ProducerBufferedBytes(5, 1000012); got != 1000012 {
		t.Errorf("five clients at 32MiB: %d each, want the largest record, 1000012", got)
	}
}

// The runtime's share is the limit less the resident pages it does not
// count (file-backed and shared, from /proc/self/status), at least half.
func TestRuntimeShare(t *testing.T) {
	t.Parallel()
	root := fakeRoot(t, map[string]string{"proc/self/status": "Name:\thipq\nVmRSS:\t   60000 kB\nRssAnon:\t   32000 kB\n" +
		"RssFile:\t   26624 kB\nRssShmem:\t    1024 kB\nVmSwap:\t       0 kB\n"})
	if got := Outside(root); got != 27*MiB {
		t.Errorf("outside: %d, want 27MiB", got)
	}
	if got := Outside(t.TempDir()); got != 0 {
		t.Errorf("outside without /proc: %d, want 0", got)
	}
	for _, c := range []struct{ limit, outside, want int64 }{
		{Default, 27 * MiB, 37 * MiB},
		{GiB, 27 * MiB, GiB - 27*MiB},
		{Min, 27 * MiB, 16 * MiB}, // at least half
		{Default, 0, Default},
	} {
		if got := RuntimeShare(c.limit, c.outside); got != c.want {
			t.Errorf("%s less %s: %s, want %s", Format(c.limit), Format(c.outside), Format(got), Format(c.want))
		}
	}
}

// Apply sets the runtime's soft limit to its share, and Keep follows the
// resident pages outside it until its context ends.
func TestApplyAndKeep(t *testing.T) {
	prev := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(prev) })
	root := fakeRoot(t, map[string]string{"proc/self/status": "RssFile:\t20480 kB\n"})
	if got := Apply(GiB, root); got != GiB-20*MiB || debug.SetMemoryLimit(-1) != GiB-20*MiB {
		t.Fatalf("share %d, runtime's limit %d; want %d", got, debug.SetMemoryLimit(-1), GiB-20*MiB)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { Keep(ctx, GiB, root, time.Millisecond); close(done) }()
	defer func() { cancel(); <-done }()
	if err := os.WriteFile(filepath.Join(root, "proc/self/status"), []byte("RssFile:\t30720 kB\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return debug.SetMemoryLimit(-1) == GiB-30*MiB },
		"the runtime's limit to follow the pages outside it up to 30MiB")
}

// Only the binary's private mappings that are not writable are read for
// a release: not another file's, not a writable one, not a shared one.
func TestBinarySpans(t *testing.T) {
	t.Parallel()
	maps := "00400000-00c00000 r-xp 00000000 fe:00 4242                       /opt/hipq (deleted)\n" +
		"00c00000-01400000 r--p 00800000 fe:00 4242                       /opt/hipq\n" +
		"01500000-01600000 rw-p 01100000 fe:00 4242                       /opt/hipq\n" +
		"01600000-01700000 r--s 01200000 fe:00 4242                       /opt/hipq\n" + // shared
		"01700000-01800000 r--p 01300000 fe:00 4242                       /opt/hipq with spaces\n" +
		"garbage line\n" +
		"7f000000-7f100000 r-xp 00000000 fe:00 9999                       /usr/lib/libc.so\n" +
		"7f100000-7f200000 r-xp 00000000 fe:01 4242                       /mnt/other\n" + // another device
		"7ffd0000-7ffd1000 r-xp 00000000 00:00 0                          [vdso]\n"
	got := binarySpans(strings.NewReader(maps), 0x401234)
	want := []span{{0x400000, 0xc00000}, {0xc00000, 0x1400000}, {0x1700000, 0x1800000}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("spans %x, want %x", got, want)
	}
	if got := binarySpans(strings.NewReader(maps), 0x7ffd0010); got != nil {
		t.Errorf("spans %x with pc in an anonymous mapping, want none", got)
	}
	if got := binarySpans(strings.NewReader(maps), 0x10); got != nil {
		t.Errorf("spans %x with pc in no mapping, want none", got)
	}
}

// Of a mapping, only the runs of pages resident and the file's own are
// released: not a page absent, swapped out or privately copied.
func TestFileRuns(t *testing.T) {
	t.Parallel()
	const page = 0x1000
	const present, swapped, file = 1 << 63, 1 << 62, 1 << 61
	entries := []uint64{
		present | file, present | file, // a run
		0,              // absent
		swapped,        // swapped out (a private copy)
		present,        // a private copy, resident
		present | file, // a run of one
		file,           // not present
		present | file, present | file, present | file,
	}
	base := uintptr(0x400000)
	buf := make([]byte, 8*(int(base/page)+len(entries)))
	for i, e := range entries {
		binary.NativeEndian.PutUint64(buf[8*(int(base/page)+i):], e)
	}
	got := fileRuns(bytes.NewReader(buf), span{base, base + uintptr(len(entries))*page}, page)
	want := []span{{base, base + 2*page}, {base + 5*page, base + 6*page}, {base + 7*page, base + 10*page}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("runs %x, want %x", got, want)
	}
	// A pagemap that ends before the span: nothing to release.
	if got := fileRuns(bytes.NewReader(buf[:len(buf)-8]), span{base, base + uintptr(len(entries))*page}, page); got != nil {
		t.Errorf("runs %x from a short pagemap, want none", got)
	}
}

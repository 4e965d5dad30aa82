// Package memlimit resolves how much memory a hipq process may use, and
// what each of the buffers that would otherwise grow with a burst gets of
// it: the Go runtime's soft limit, the consumers' fetches and the
// producers' buffers (Split).
//
// The limit is, in order: the config's memory_limit; else GOMEMLIMIT, in
// Go's syntax; else 90% of the memory limit of the process's cgroup (v2
// memory.max, v1 memory.limit_in_bytes), the rest being left to what the
// Go runtime does not count (the binary's own pages, the kernel's
// buffers); else Default. An explicit value above 90% of the cgroup's
// limit is lowered to it: the kernel would kill the process before the
// runtime's soft limit made the collector work harder.
package memlimit

import (
	"bufio"
	"errors"
	"fmt"
	"math"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
)

// Sizes.
const (
	KiB = 1 << 10
	MiB = 1 << 20
	GiB = 1 << 30
)

const (
	// Default is the limit when nothing sets one.
	Default = 64 * MiB
	// Min is the smallest limit hipq accepts. The binary's own pages in
	// use (about 20 MiB, outside the runtime's memory) and the heap at
	// rest (10 to 15 MiB) nearly fill it already: at this limit a burst
	// runs at a fraction of its speed, the collector running all along,
	// and the resident set passes the limit by half.
	Min = 32 * MiB
	// cgroupPercent of a cgroup's limit is what the process takes.
	cgroupPercent = 90
	// unlimited: a cgroup limit at or above it is no limit (cgroup v1
	// writes "no limit" as the largest page-aligned int64).
	unlimited = 1 << 62
)

// Source is where a limit came from.
type Source string

// Sources.
const (
	FromConfig  Source = "memory_limit"
	FromEnv     Source = "GOMEMLIMIT"
	FromCgroup  Source = "cgroup"
	FromDefault Source = "default"
)

// Limit is a resolved limit.
type Limit struct {
	Bytes int64
	From  Source
	// Cgroup is the limit of the process's cgroup (0: none) and
	// CgroupFile the file that set it.
	Cgroup     int64
	CgroupFile string
	// Asked is the explicit limit (memory_limit or GOMEMLIMIT) when it
	// was above 90% of the cgroup's limit and Bytes is lowered to that;
	// 0 otherwise.
	Asked int64
}

// Env is where Resolve looks: the environment and the file system root
// under which /proc/self/cgroup and /sys/fs/cgroup are read ("/" in a
// process; a test's directory in tests).
type Env struct {
	Lookup func(string) (string, bool)
	Root   string
}

// System is the process's own environment.
func System() Env { return Env{Lookup: os.LookupEnv, Root: "/"} }

// Resolve returns the limit: configured (memory_limit; 0 = not set), else
// GOMEMLIMIT, else 90% of the cgroup's limit, else Default. An explicit
// limit above 90% of the cgroup's is lowered to it (Asked says so).
// GOMEMLIMIT=off counts as not set.
func Resolve(configured int64, env Env) (Limit, error) {
	var l Limit
	l.Cgroup, l.CgroupFile = cgroupLimit(env.Root)
	ceiling := l.Cgroup / 100 * cgroupPercent
	env.Lookup = orNoEnv(env.Lookup)
	switch v, set := env.Lookup("GOMEMLIMIT"); {
	case configured > 0:
		l.Bytes, l.From = configured, FromConfig
	case set && strings.TrimSpace(v) != "" && v != "off":
		n, err := ParseGoMemLimit(v)
		if err != nil {
			return Limit{}, fmt.Errorf("GOMEMLIMIT: %w", err)
		}
		if n < Min {
			return Limit{}, fmt.Errorf("GOMEMLIMIT: %s is below hipq's minimum of %s", Format(n), Format(Min))
		}
		l.Bytes, l.From = n, FromEnv
	case ceiling > 0:
		l.Bytes, l.From = ceiling, FromCgroup
	default:
		l.Bytes, l.From = Default, FromDefault
	}
	if ceiling > 0 && l.Bytes > ceiling {
		l.Asked, l.Bytes = l.Bytes, ceiling
	}
	return l, nil
}

// Origin says where the limit came from, for the log: the config key,
// the variable, or the cgroup's file.
func (l Limit) Origin() string {
	if l.From == FromCgroup {
		return fmt.Sprintf("%d%% of the cgroup's limit (%s: %s)", cgroupPercent, l.CgroupFile, Format(l.Cgroup))
	}
	return string(l.From)
}

func orNoEnv(f func(string) (string, bool)) func(string) (string, bool) {
	if f != nil {
		return f
	}
	return func(string) (string, bool) { return "", false }
}

// cgroupLimit is the smallest memory limit set on the process's cgroup or
// any above it, in cgroup v2 (memory.max) or v1 (memory.limit_in_bytes),
// and the file that set it; 0 when none is set. The process's cgroup is
// read from /proc/self/cgroup; in a container with a cgroup namespace it
// is the root of /sys/fs/cgroup, and outside one (a systemd unit's
// MemoryMax) a folder under it. A folder that is not there (a host path
// seen from a container without a namespace) is passed over, up to the
// root, which a container's runtime mounts as its own.
func cgroupLimit(root string) (int64, string) {
	if root == "" {
		root = "/"
	}
	v2, v1 := "/", "/"
	if f, err := os.Open(filepath.Join(root, "proc/self/cgroup")); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			// hierarchy-ID:controller-list:cgroup-path
			parts := strings.SplitN(sc.Text(), ":", 3)
			if len(parts) != 3 {
				continue
			}
			switch {
			case parts[0] == "0" && parts[1] == "":
				v2 = parts[2]
			case containsController(parts[1], "memory"):
				v1 = parts[2]
			}
		}
		f.Close()
	}
	var best int64
	var file string
	for _, c := range []struct{ base, cgroup, name string }{
		{"sys/fs/cgroup", v2, "memory.max"},
		{"sys/fs/cgroup/memory", v1, "memory.limit_in_bytes"},
	} {
		for p := path.Clean("/" + c.cgroup); ; p = path.Dir(p) {
			name := filepath.Join(root, c.base, p, c.name)
			if n := readLimit(name); n > 0 && (best == 0 || n < best) {
				best, file = n, filepath.Join("/", c.base, p, c.name)
			}
			if p == "/" {
				break
			}
		}
	}
	return best, file
}

func containsController(list, name string) bool {
	for _, c := range strings.Split(list, ",") {
		if c == name {
			return true
		}
	}
	return false
}

// readLimit is a cgroup limit file's bytes; 0 when it is missing,
// unreadable or sets no limit ("max", or cgroup v1's huge number).
func readLimit(name string) int64 {
	b, err := os.ReadFile(name)
	if err != nil {
		return 0
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n <= 0 || n >= unlimited {
		return 0
	}
	return n
}

// ParseSize reads a size as the config writes it: a whole number of
// bytes, or a number with a unit: B, KB, MB, GB, TB (powers of 1000) or
// KiB, MiB, GiB, TiB (powers of 1024), as in 64MiB, 512MB or 1.5GiB.
func ParseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	i := strings.IndexFunc(s, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	num, unit := s, ""
	if i >= 0 {
		num, unit = s[:i], strings.TrimSpace(s[i:])
	}
	mult, ok := map[string]float64{"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
		"KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": 1 << 40}[unit]
	if !ok {
		return 0, fmt.Errorf("%q is not a size such as 64MiB, 512MB or 1GiB (unit %q is not one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)", s, unit)
	}
	v, err := strconv.ParseFloat(num, 64)
	if num == "" || err != nil {
		return 0, fmt.Errorf("%q is not a size such as 64MiB, 512MB or 1GiB", s)
	}
	if v*mult >= math.MaxInt64 {
		return 0, fmt.Errorf("%q is too large", s)
	}
	return int64(v * mult), nil
}

// ParseGoMemLimit reads GOMEMLIMIT's syntax (runtime/debug.SetMemoryLimit):
// a whole number of bytes with an optional unit, B, KiB, MiB, GiB or TiB.
// "off" is not a limit: an error here.
func ParseGoMemLimit(s string) (int64, error) {
	i := strings.IndexFunc(s, func(r rune) bool { return r < '0' || r > '9' })
	num, unit := s, ""
	if i >= 0 {
		num, unit = s[:i], s[i:]
	}
	mult, ok := map[string]int64{"": 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": 1 << 40}[unit]
	n, err := strconv.ParseInt(num, 10, 64)
	if !ok || err != nil {
		return 0, fmt.Errorf("%q is not a size in Go's syntax, such as 64MiB (units B, KiB, MiB, GiB, TiB)", s)
	}
	if n > math.MaxInt64/mult {
		return 0, errors.New("too large")
	}
	return n * mult, nil
}

// Format writes n in the largest binary unit that divides it, else in
// MiB with a decimal: 64MiB, 1GiB, 57.6MiB.
func Format(n int64) string {
	switch {
	case n == 0:
		return "0"
	case n%GiB == 0:
		return fmt.Sprintf("%dGiB", n/GiB)
	case n%MiB == 0:
		return fmt.Sprintf("%dMiB", n/MiB)
	case n%KiB == 0 && n < MiB:
		return fmt.Sprintf("%dKiB", n/KiB)
	}
	return fmt.Sprintf("%.1fMiB", float64(n)/MiB)
}

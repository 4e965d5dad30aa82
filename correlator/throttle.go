package correlator

import (
	"encoding/json"
	"fmt"
	"math/big"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Throttle is what bounds the running jobs of one queue (SPEC §8). The
// claim applies it across every hipq instance at once; the zero value bounds
// nothing.
type Throttle struct {
	// Limit is the most total throttle_factor of running non-critical jobs;
	// < 1 is unlimited.
	Limit int
	// Shares split Limit among partitions of the queue's jobs; nil = none.
	Shares *Shares
	// Critical names the queue's types that count against neither Limit
	// nor Shares.
	Critical []string
	// MaxConcurrency caps the running jobs of a type (a count), critical
	// or not; types not listed are not capped.
	MaxConcurrency map[string]int
	// Rates are sliding-window limits on requests sent, critical types
	// included.
	Rates []Rate
}

// Rate is a sliding-window limit: no interval of length Period holds more
// than Limit requests that may have reached the downstream, across every
// instance. The zero Type applies to every type of the queue; a Path makes
// a window per value of job_data at that pointer (a missing value is "").
type Rate struct {
	// Key names the rate durably (its units in PostgreSQL): the queue's or
	// type's name and the rate's position.
	Key     string
	Limit   int
	Period  time.Duration
	Type    string
	Pointer string
	Path    []string
}

// NewRate builds a rate; pointer, when set, is a JSON pointer into
// job_data.
func NewRate(key string, limit int, period time.Duration, jobType, pointer string) (Rate, error) {
	r := Rate{Key: key, Limit: limit, Period: period, Type: jobType, Pointer: pointer}
	switch {
	case limit < 1:
		return r, fmt.Errorf("limit %d must be at least 1", limit)
	case period < time.Millisecond:
		return r, fmt.Errorf("period %v must be at least 1ms", period)
	}
	if pointer != "" {
		if !strings.HasPrefix(pointer, "/") {
			return r, fmt.Errorf("by: %q is not a JSON pointer into job_data (it must start with /)", pointer)
		}
		for _, seg := range strings.Split(pointer[1:], "/") {
			r.Path = append(r.Path, strings.ReplaceAll(strings.ReplaceAll(seg, "~1", "/"), "~0", "~"))
		}
	}
	return r, nil
}

// Bounded reports whether the claim must count running jobs at all.
func (t *Throttle) Bounded() bool {
	return t.Limit >= 1 || len(t.MaxConcurrency) > 0 || len(t.Rates) > 0
}

// CountsRunning reports whether the claim counts the running jobs (a
// Limit, or per-type caps): then it reads them, and its walk may pass due
// jobs over for them, so it reads more candidates than the batch. Rates
// alone count requests, not running jobs.
func (t *Throttle) CountsRunning() bool {
	return len(t.MaxConcurrency) > 0 || t.Limit >= 1
}

// OtherPartition names the pooled partition of values not listed in the
// weights (SPEC §8: the weight of key "*").
const OtherPartition = "*"

// Shares split a queue's throttle limit among partitions of its jobs, named
// by the value a JSON pointer finds in job_data.
type Shares struct {
	Pointer string
	// Path is Pointer as a PostgreSQL text[] path (job_data #>> Path).
	Path []string
	// Caps is the most total throttle_factor each listed value may run:
	// floor(limit × weight ÷ total weight), at least 1.
	Caps map[string]int
	// OtherCap bounds the pooled partition of every value not listed
	// (absent ones included) when the weights have "*"; 0 = only the
	// queue limit bounds them.
	OtherCap int
}

// NewShares computes the partition caps of weights under limit. The
// pointer is an RFC 6901 JSON pointer into job_data.
func NewShares(pointer string, weights map[string]int, limit int) (*Shares, error) {
	if !strings.HasPrefix(pointer, "/") {
		return nil, fmt.Errorf("%q is not a JSON pointer into job_data (it must start with /)", pointer)
	}
	if limit < 1 {
		return nil, fmt.Errorf("shares need throttle_limit >= 1")
	}
	total := 0
	for k, w := range weights {
		if w < 1 {
			return nil, fmt.Errorf("weight of %q must be a positive integer", k)
		}
		total += w
	}
	if total == 0 {
		return nil, fmt.Errorf("at least one weight is required")
	}
	s := &Shares{Pointer: pointer, Path: PointerTokens(pointer), Caps: map[string]int{}}
	for k, w := range weights {
		c := max(1, int(int64(limit)*int64(w)/int64(total)))
		if k == OtherPartition {
			s.OtherCap = c
		} else {
			s.Caps[k] = c
		}
	}
	return s, nil
}

// Partition returns the partition jobData falls in and its cap (0 = not
// bounded by shares). It reads the value as PostgreSQL's #>> does: a
// string as itself, a number or boolean as its JSON text; a value not
// listed, absent or null falls in the pooled "*" partition.
func (s *Shares) Partition(jobData json.RawMessage) (name string, cap int) {
	var doc any
	d := json.NewDecoder(strings.NewReader(string(jobData)))
	d.UseNumber()
	if d.Decode(&doc) == nil {
		v, ok := pointer(doc, s.Pointer)
		var key string
		switch x := v.(type) {
		case string:
			key = x
		case json.Number:
			key = numericText(x)
		case bool:
			key = fmt.Sprint(x)
		default:
			ok = false
		}
		if c, listed := s.Caps[key]; ok && listed {
			return key, c
		}
	}
	return OtherPartition, s.OtherCap
}

// numericText is a JSON number as PostgreSQL's #>> writes it: the numeric
// it reads, with no exponent and as many decimals as the number carried
// after its exponent is applied (1e2 is 100, 1.50 is 1.50, 15e-1 is 1.5,
// -0 is 0). A number it cannot read stays as written.
func numericText(n json.Number) string {
	s := string(n)
	mant, exp := s, 0
	if i := strings.IndexAny(s, "eE"); i >= 0 {
		e, err := strconv.Atoi(s[i+1:])
		if err != nil {
			return s
		}
		mant, exp = s[:i], e
	}
	decimals := 0
	if i := strings.IndexByte(mant, '.'); i >= 0 {
		decimals = len(mant) - i - 1
	}
	r, ok := new(big.Rat).SetString(s)
	if !ok {
		return s
	}
	return r.FloatString(max(0, decimals-exp))
}

// String lists the caps, for logs.
func (s *Shares) String() string {
	if s == nil {
		return "none"
	}
	keys := make([]string, 0, len(s.Caps))
	for k := range s.Caps {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "by %s:", s.Pointer)
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%d", k, s.Caps[k])
	}
	if s.OtherCap > 0 {
		fmt.Fprintf(&b, " *=%d", s.OtherCap)
	}
	return b.String()
}

// PartitionOf is Partition for a value already read from job_data as
// PostgreSQL's #>> reads it (nil: missing or null): the value when listed,
// else the pooled "*" partition, and its cap (0 = not bounded by shares).
func (s *Shares) PartitionOf(value *string) (name string, cap int) {
	if value != nil {
		if c, listed := s.Caps[*value]; listed {
			return *value, c
		}
	}
	return OtherPartition, s.OtherCap
}

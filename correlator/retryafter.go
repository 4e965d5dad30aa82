package correlator

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// RetryAfter is a downstream's "not before": a delay (an HTTP
// Retry-After in seconds, a reply's retry_after) or a time (an HTTP date,
// RFC 3339). The zero value says nothing.
type RetryAfter struct {
	Delay time.Duration
	At    time.Time
}

// IsZero reports whether it says nothing.
func (r RetryAfter) IsZero() bool { return r.Delay <= 0 && r.At.IsZero() }

// From is the earliest time it allows, on the clock now reads; zero when
// it says nothing.
func (r RetryAfter) From(now time.Time) time.Time {
	switch {
	case !r.At.IsZero():
		return r.At
	case r.Delay > 0:
		return now.Add(r.Delay)
	}
	return time.Time{}
}

// maxRetryAfter bounds a delay read from a downstream: a year.
const maxRetryAfter = 365 * 24 * time.Hour

// ParseRetryAfter reads a Retry-After: non-negative seconds (a decimal is
// taken too), an HTTP date or an RFC 3339 time.
func ParseRetryAfter(s string) (RetryAfter, bool) {
	s = strings.TrimSpace(s)
	if secs, err := strconv.ParseFloat(s, 64); err == nil {
		if secs < 0 || math.IsNaN(secs) || math.IsInf(secs, 0) {
			return RetryAfter{}, false
		}
		if secs >= maxRetryAfter.Seconds() { // and no overflow on the way
			return RetryAfter{Delay: maxRetryAfter}, true
		}
		return RetryAfter{Delay: time.Duration(secs * float64(time.Second))}, true
	}
	if t, err := http.ParseTime(s); err == nil {
		return RetryAfter{At: t}, true
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return RetryAfter{At: t}, true
	}
	return RetryAfter{}, false
}

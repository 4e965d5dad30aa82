package correlator

import (
	"math"
	"math/rand/v2"
	"slices"
	"time"
)

// RetryPolicy decides whether a failed attempt is tried again and when.
// Library users may plug in their own.
type RetryPolicy interface {
	// Next is called after attempt (1-based) ended with outcome. It returns
	// the delay before the next attempt, or ok=false when the job is to end.
	Next(attempt int, outcome AttemptOutcome) (delay time.Duration, ok bool)
	// MaxAttempts is the most attempts a job of this policy makes; it is
	// stored on each job.
	MaxAttempts() int
}

// Backoff is the configurable policy: fixed or exponential delays with
// jitter, a cap on attempts and the outcomes that are retried.
type Backoff struct {
	Attempts    int              // at least 1; 1 means no retry
	Exponential bool             // false: fixed delay of Initial
	Initial     time.Duration    // first delay
	Multiplier  float64          // growth per attempt (exponential)
	Max         time.Duration    // cap on one delay (0 = none)
	Jitter      float64          // 0..1: the delay is spread by ±Jitter
	When        []AttemptOutcome // outcomes that are retried

	// Rand returns a number in [0,1); nil uses math/rand/v2. Tests set it.
	Rand func() float64
}

// Defaults of a configured retry policy (retry: with keys left out).
const (
	DefaultRetryAttempts   = 5
	DefaultRetryInitial    = 10 * time.Second
	DefaultRetryMultiplier = 2.0
	DefaultRetryMax        = time.Hour
	DefaultRetryJitter     = 0.1
)

// DefaultRetryWhen are the outcomes retried when a policy names none: all
// of them, but an at_most_once type never retries a timeout (its request
// may have arrived).
func DefaultRetryWhen(d Delivery) []AttemptOutcome {
	if d == AtMostOnce {
		return []AttemptOutcome{AttemptFailed, AttemptDispatchError}
	}
	return []AttemptOutcome{AttemptFailed, AttemptTimedOut, AttemptDispatchError}
}

// NoRetry is the default policy: one attempt.
var NoRetry RetryPolicy = &Backoff{Attempts: 1}

// MaxDelay implements MaxDelayer: Max, the cap on one delay (0: none).
func (b *Backoff) MaxDelay() time.Duration { return b.Max }

// MaxAttempts implements RetryPolicy.
func (b *Backoff) MaxAttempts() int { return max(b.Attempts, 1) }

// Next implements RetryPolicy.
func (b *Backoff) Next(attempt int, outcome AttemptOutcome) (time.Duration, bool) {
	if attempt >= b.MaxAttempts() || !slices.Contains(b.When, outcome) {
		return 0, false
	}
	return b.Delay(attempt), true
}

// Delay is the wait after the given attempt (1-based), jitter included.
func (b *Backoff) Delay(attempt int) time.Duration {
	d := float64(b.Initial)
	if b.Exponential && attempt > 1 {
		m := b.Multiplier
		if m <= 0 {
			m = DefaultRetryMultiplier
		}
		d *= math.Pow(m, float64(attempt-1))
	}
	if b.Max > 0 && d > float64(b.Max) {
		d = float64(b.Max)
	}
	if b.Jitter > 0 {
		r := b.Rand
		if r == nil {
			r = rand.Float64
		}
		d += d * b.Jitter * (2*r() - 1)
	}
	if d < 0 || math.IsNaN(d) {
		d = 0
	}
	if d > float64(math.MaxInt64) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(d)
}

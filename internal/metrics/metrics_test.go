package metrics

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
)

// hipq_jobs reports every state of every known queue (0 included), reuses
// a count for minAge, and shows nothing rather than stale figures when a
// count fails.
func TestCountJobs(t *testing.T) {
	m := New()
	calls := 0
	var fail error
	counts := []correlator.JobCount{{Queue: "default", State: "running", N: 3}, {Queue: "other", State: "retry", N: 2}}
	m.CountJobs(func(context.Context) ([]correlator.JobCount, error) {
		calls++
		return counts, fail
	}, []string{"default", "empty"}, time.Hour)
	get := func(queue, state string) float64 {
		t.Helper()
		v, ok := m.Value("hipq_jobs", map[string]string{"queue": queue, "state": state})
		if !ok {
			t.Fatalf("no hipq_jobs{queue=%q,state=%q}", queue, state)
		}
		return v
	}
	if get("default", "running") != 3 || get("other", "retry") != 2 || get("default", "retry") != 0 || get("empty", "initial") != 0 {
		t.Fatal("counts not reported as counted, with zeros for the rest")
	}
	if _, ok := m.Value("hipq_jobs", map[string]string{"queue": "default", "state": "final"}); ok {
		t.Fatal("final jobs reported: they are never counted")
	}
	counts[0].N = 9
	if get("default", "running") != 3 || calls != 1 {
		t.Fatalf("count not reused within minAge: %d calls", calls)
	}
	m2 := New()
	m2.CountJobs(func(context.Context) ([]correlator.JobCount, error) { return nil, errors.New("down") }, []string{"default"}, 0)
	if _, ok := m2.Value("hipq_jobs", nil); ok {
		t.Fatal("a failed count reported figures")
	}
	// Each scrape counts; this one's own failure may be collected after the
	// counter is read, so at least the first scrape's shows.
	if v, _ := m2.Value("hipq_jobs_count_errors_total", nil); v < 1 {
		t.Fatalf("count errors %v, want at least 1", v)
	}
}

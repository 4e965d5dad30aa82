package store_test

import (
	"fmt"
	"testing"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// BenchmarkClaim claims batches of 500 from a backlog with 1000 jobs
// running, with no limit, a (non-binding) limit, and a limit with shares:
// what the throttle costs a claim.
func BenchmarkClaim(b *testing.B) {
	shares, _ := correlator.NewShares("/region", map[string]int{"a": 1, "b": 1, "c": 1}, 100000)
	for _, bc := range []struct {
		name string
		th   correlator.Throttle
	}{
		{"unthrottled", correlator.Throttle{}},
		{"limit", correlator.Throttle{Limit: 100000}},
		{"shares", correlator.Throttle{Limit: 100000, Shares: shares}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			st := pgtest.New(b)
			var js []*correlator.Job
			for i := range 1000 + 500*b.N {
				js = append(js, job(fmt.Sprintf("k%d", i), region(string(rune('a'+i%3)))))
			}
			for len(js) > 0 {
				n := min(len(js), 5000)
				insert(b, st, js[:n]...)
				js = js[n:]
			}
			if _, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 1000, Instance: "b"}); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for range b.N {
				c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 500, Instance: "b", Throttle: bc.th})
				if err != nil || len(c.Jobs) != 500 {
					b.Fatalf("claimed %d: %v", len(c.Jobs), err)
				}
			}
		})
	}
}

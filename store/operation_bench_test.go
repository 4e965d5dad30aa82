package store_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// BenchmarkBulkCancelWhileIntakeFlows cancels 100,000 jobs of one queue
// by filter, in batches paced as the API paces them (a pause as long as
// each batch took), while the hot path of another queue inserts, claims
// and ends jobs (their replies applied) as fast as it can. It reports the hot path's jobs per second
// during the cancel against the same span without it (hot_ratio; the goal
// is at least 0.8), and how long the cancel took. It checks that every
// matched job ended cancelled and nothing of the other queue was touched.
func BenchmarkBulkCancelWhileIntakeFlows(b *testing.B) {
	const backlog = 100_000
	for range b.N {
		b.StopTimer()
		st := pgtest.New(b)
		var js []*correlator.Job
		for i := range backlog {
			js = append(js, job(fmt.Sprintf("bulk-%d", i), func(j *correlator.Job) { j.Queue, j.JobType = "bulk", "u" }))
		}
		for len(js) > 0 {
			n := min(len(js), 5000)
			insert(b, st, js[:n]...)
			js = js[n:]
		}
		hot := func(ctx context.Context, moved *atomic.Int64) {
			for i := 0; ctx.Err() == nil; i++ {
				batch := make([]*correlator.Job, 100)
				for k := range batch {
					batch[k] = job(fmt.Sprintf("hot-%d-%d", i, k))
				}
				if _, err := st.JobsInsert(ctx, batch); err != nil {
					return
				}
				c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 100, Instance: "bench", Types: []string{"t"}})
				if err != nil {
					return
				}
				// Their replies come back: each claimed job ends.
				replies := make([]store.ReplyIn, len(c.Jobs))
				for k := range c.Jobs {
					replies[k] = reply(c.Jobs[k].JobKey, c.Jobs[k].Attempt, true)
				}
				if _, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: replies}, typeInfo); err != nil {
					return
				}
				moved.Add(int64(len(batch) + 2*len(c.Jobs)))
			}
		}
		// measure runs the hot path until work returns (or for span when
		// work is nil) and gives its jobs per second and how long it ran.
		measure := func(span time.Duration, work func(context.Context)) (float64, time.Duration) {
			ctx, cancel := context.WithTimeout(context.Background(), span)
			defer cancel()
			var moved atomic.Int64
			var wg sync.WaitGroup
			wg.Add(1)
			hctx, stop := context.WithCancel(ctx)
			go func() { defer wg.Done(); hot(hctx, &moved) }()
			began := time.Now()
			if work != nil {
				work(ctx)
			} else {
				<-ctx.Done()
			}
			ran := time.Since(began)
			stop()
			wg.Wait()
			return float64(moved.Load()) / ran.Seconds(), ran
		}
		b.StartTimer()
		during, took := measure(5*time.Minute, func(ctx context.Context) {
			now, _ := st.DatabaseNow(ctx)
			op, err := st.OperationCreate(ctx, store.Operation{Kind: store.OperationCancel, Reason: "bench", TokenName: "bench",
				Jobs: &store.JobFilter{Queue: "bulk", CreatedBefore: &now}}, "bench", time.Minute)
			if err != nil {
				b.Error(err)
				return
			}
			for op.State == store.OperationRunning && ctx.Err() == nil {
				t := time.Now()
				if op, err = st.OperationStep(ctx, op.ID, store.OperationWork{Owner: "bench", Lease: time.Minute}); err != nil {
					b.Error(err)
					return
				}
				time.Sleep(time.Since(t))
			}
			if op.State != store.OperationDone || op.Done != backlog {
				b.Errorf("the cancel did not end: %+v", op)
			}
		})
		b.StopTimer()
		without, _ := measure(took, nil) // (the same span, once the cancel is over)
		b.StopTimer()
		b.ReportMetric(without, "hot_jobs/s_without")
		b.ReportMetric(during, "hot_jobs/s_during")
		b.ReportMetric(during/without, "hot_ratio")
		b.ReportMetric(took.Seconds(), "cancel_s")
		if n := count(b, st, `SELECT count(*) FROM hipq_job WHERE queue = 'bulk' AND outcome IS DISTINCT FROM 'cancelled'`); n != 0 {
			b.Errorf("%d jobs of the filter not cancelled", n)
		}
		if n := count(b, st, `SELECT count(*) FROM hipq_job WHERE queue = 'default' AND outcome = 'cancelled'`); n != 0 {
			b.Errorf("%d jobs outside the filter cancelled", n)
		}
	}
}

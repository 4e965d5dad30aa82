// Package activity keeps the dashboard's chart: every few seconds an
// instance adds what it counted since the last time (sends by queue,
// replies that ended an attempt) to its row of the minute in
// hipq_activity. The counts come from the process's metrics, so the hot
// paths do nothing more for it; a crash loses at most one interval of a
// chart, never a job.
package activity

import (
	"context"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// DefaultEvery is how often an instance writes its counts.
const DefaultEvery = 5 * time.Second

// Recorder writes one instance's activity.
type Recorder struct {
	log      *zap.Logger
	st       *store.Store
	m        *metrics.Metrics
	instance string
	types    correlator.Types
	every    time.Duration
	last     map[string][2]float64 // totals by queue at the last write
}

// New builds a recorder; every <= 0 is DefaultEvery.
func New(log *zap.Logger, st *store.Store, m *metrics.Metrics, instance string, types correlator.Types, every time.Duration) *Recorder {
	if every <= 0 {
		every = DefaultEvery
	}
	return &Recorder{log: log.Named("activity"), st: st, m: m, instance: instance, types: types, every: every,
		last: map[string][2]float64{}}
}

// Run writes every interval until ctx ends, then once more.
func (r *Recorder) Run(ctx context.Context) error {
	t := time.NewTicker(r.every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			r.write(wctx)
			cancel()
			return nil
		case <-t.C:
			r.write(ctx)
		}
	}
}

// write adds what was counted since the last successful write; a failed
// write is tried again with more next time.
func (r *Recorder) write(ctx context.Context) {
	now := r.totals()
	var rows []store.Activity
	for q, v := range now {
		d, rep := v[0]-r.last[q][0], v[1]-r.last[q][1]
		if d > 0 || rep > 0 {
			rows = append(rows, store.Activity{Minute: time.Now(), Queue: q, Dispatched: int64(d), Replied: int64(rep)})
		}
	}
	if err := r.st.ActivityAdd(ctx, r.instance, rows); err != nil {
		if ctx.Err() == nil {
			r.log.Warn("activity not written; added to the next write", zap.Error(err))
		}
		return
	}
	r.last = now
}

// totals reads the process's counters: sends by queue, and replies that
// ended an attempt (round trips, by job type, mapped to their queue).
func (r *Recorder) totals() map[string][2]float64 {
	out := map[string][2]float64{}
	fams, err := r.m.Registry().Gather()
	if err != nil {
		return out
	}
	for _, f := range fams {
		switch f.GetName() {
		case "hipq_dispatches_total":
			for _, m := range f.GetMetric() {
				if label(m, "result") == "sent" {
					v := out[label(m, "queue")]
					v[0] += m.GetCounter().GetValue()
					out[label(m, "queue")] = v
				}
			}
		case "hipq_round_trip_seconds":
			for _, m := range f.GetMetric() {
				jt := r.types[label(m, "job_type")]
				if jt == nil {
					continue
				}
				v := out[jt.Queue]
				v[1] += float64(m.GetHistogram().GetSampleCount())
				out[jt.Queue] = v
			}
		}
	}
	return out
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

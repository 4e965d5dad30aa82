package consumer

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"reflect"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// IntakeConfig configures the intake consumer.
type IntakeConfig struct {
	GroupConfig
	DeadLetterTopic string
	MaxBytes        int
	Types           correlator.Types
	Instance        string // recorded on the attempts of jobs claimed at intake (ClaimFor)
}

// Intake turns job requests read from the intake topics into jobs.
type Intake struct {
	g       *group
	cfg     IntakeConfig
	claimer Claimer
}

// Claimer is this instance's dispatcher, seen by the intake: it reserves
// room for due jobs the intake claims as it stores them (a write of the
// row instead of an insert and a claim), and sends them once stored. The
// intake and the dispatcher never call each other: cmd wires one to the
// other through this seam (ClaimerFunc).
type Claimer interface {
	// Reserve holds room for new jobs of queue (jobTypes: one entry per
	// job), or returns nil when the queue takes none at intake now.
	Reserve(queue string, jobTypes []string) Reservation
}

// ClaimerFunc is a Claimer made of a function.
type ClaimerFunc func(queue string, jobTypes []string) Reservation

// Reserve calls f.
func (f ClaimerFunc) Reserve(queue string, jobTypes []string) Reservation { return f(queue, jobTypes) }

// Reservation is room held for the jobs of one queue claimed as they are
// stored. It ends in Deliver (the batch committed) or Release (it failed).
type Reservation interface {
	// Room is how many jobs it holds room for.
	Room() int
	// Takes says whether a job of this type may be claimed under it.
	Takes(jobType string) bool
	// Order is the queue's order: the room goes to the jobs claimed first.
	Order() correlator.Order
	// Limits are the queue's limits (the zero Throttle: none): the store
	// claims only what they leave room for (store.IntakeBatch.Limits).
	Limits() store.IntakeLimits
	// Deliver sends the jobs claimed under it and gives back the room
	// they did not use.
	Deliver(ctx context.Context, jobs []store.Claimed)
	// Release gives the room back; after Deliver it does nothing.
	Release()
}

// ClaimFor lets the intake claim the due jobs it stores for c to send
// (before Run). Without it, the dispatcher claims them from the table.
func (in *Intake) ClaimFor(c Claimer, instance string) {
	in.claimer, in.cfg.Instance = c, instance
}

// NewIntake builds the intake consumer; Run starts it.
func NewIntake(log *zap.Logger, st *store.Store, cfg IntakeConfig) (*Intake, error) {
	cfg.GroupConfig = cfg.GroupConfig.WithDefaults()
	in := &Intake{cfg: cfg}
	g, err := newGroup(log.Named("intake"), st, cfg.GroupConfig, in)
	if err != nil {
		return nil, err
	}
	in.g = g
	return in, nil
}

// Run polls and applies job requests until ctx ends, then leaves the group.
func (in *Intake) Run(ctx context.Context) error { return in.g.Run(ctx) }

// Stalled is nil while no partition waits on a refusal that is not the
// records' own, else what waits and why (readiness).
func (in *Intake) Stalled() error { return in.g.Stalled() }

func (in *Intake) count(result string, n int) {
	if n > 0 {
		in.cfg.Metrics.IntakeRecords.WithLabelValues(metrics.SourceKafka, result).Add(float64(n))
	}
}

func (in *Intake) apply(ctx context.Context, recs []*kgo.Record, refused []refusal, adv []store.OffsetAdvance, compare bool) (func(), error, error) {
	now := time.Now()
	b := store.IntakeBatch{Group: in.cfg.Group, Offsets: adv, MustWrite: compare}
	var dups int
	b.Jobs, b.DeadLetters, dups = in.decode(recs, now)
	if dls := deadLetters(refused, store.SourceIntake); compare && len(refused) > 0 {
		b.Retry = &store.IntakeRetry{Refused: dls}
		b.Retry.Jobs, b.Retry.DeadLetters, b.Retry.Duplicates = in.decode(recsOf(refused), now)
	} else {
		b.DeadLetters = append(b.DeadLetters, dls...)
	}
	rs := in.reserve(b.Jobs)
	if len(rs) > 0 {
		b.Limits = make(map[string]store.IntakeLimits, len(rs))
		for q, r := range rs {
			b.Limits[q] = r.Limits()
		}
	}
	b.Instance = in.cfg.Instance
	res, err := in.g.st.IntakeApply(ctx, b)
	if err != nil {
		for _, r := range rs {
			r.Release()
		}
		return nil, nil, err
	}
	return func() {
		claimed := make(map[Reservation][]store.Claimed, len(rs))
		for _, c := range res.Claimed {
			r := rs[c.Queue]
			if claimed[r] == nil && r != nil {
				claimed[r] = make([]store.Claimed, 0, r.Room())
			}
			claimed[r] = append(claimed[r], c)
		}
		for _, r := range rs {
			r.Deliver(ctx, claimed[r])
		}
		in.count("accepted", res.Inserted)
		in.count("duplicate", res.Duplicates+dups)
		in.count("dead_lettered", len(res.DeadLetters))
		in.g.log.Debug("intake batch applied", zap.Int("records", len(recs)), zap.Int("accepted", res.Inserted),
			zap.Int("duplicates", res.Duplicates+dups), zap.Int("dead_lettered", len(res.DeadLetters)))
		in.g.copyDeadLetters(in.cfg.DeadLetterTopic, res.DeadLetters)
	}, res.RefusedAgain, nil
}

// decode makes jobs and dead letters of intake records.
func (in *Intake) decode(recs []*kgo.Record, now time.Time) ([]store.IntakeJob, []store.DeadLetter, int) {
	return reduceIntake(store.SourceIntake, len(recs), func(i int) (store.Source, *correlator.Job, error) {
		src := source(recs[i])
		job, err := decodeRecord(recs[i], src, in.cfg.MaxBytes, in.cfg.Types, now)
		return src, job, err
	})
}

// input names the job rec asks for: its type and key.
func (in *Intake) input(rec *kgo.Record) []string {
	job, err := decodeRecord(rec, source(rec), in.cfg.MaxBytes, in.cfg.Types, time.Now())
	if err != nil {
		return nil
	}
	return []string{job.JobType + "\x00" + job.JobKey}
}

// reserve asks the dispatcher for room for the batch's jobs that may be
// sent at once (due, unexpired, without time windows of their own: by
// this clock; the store decides by PostgreSQL's, and whether their queue
// is open), queue by queue, and marks those it may claim as they are
// stored.
func (in *Intake) reserve(jobs []store.IntakeJob) map[string]Reservation {
	if in.claimer == nil {
		return nil
	}
	now := time.Now()
	at := func(j *correlator.Job) time.Time { return cmp.Or(j.ScheduledRunTime, now) } // (zero: due at once)
	by := map[string][]int{}
	for i := range jobs {
		j := jobs[i].Job
		if j.ClaimableAtIntake(now) {
			by[j.Queue] = append(by[j.Queue], i)
		}
	}
	rs := map[string]Reservation{}
	for q, idx := range by {
		types := make([]string, len(idx))
		for k, i := range idx {
			types[k] = jobs[i].Job.JobType
		}
		r := in.claimer.Reserve(q, types)
		if r == nil {
			continue
		}
		rs[q] = r
		idx = slices.DeleteFunc(idx, func(i int) bool { return !r.Takes(jobs[i].Job.JobType) })
		if len(idx) > r.Room() {
			// The room goes to the jobs the queue's order claims first.
			order := r.Order()
			key := func(j *correlator.Job) correlator.OrderKey {
				return correlator.OrderKey{Scheduled: at(j), Priority: j.Priority}
			}
			slices.SortStableFunc(idx, func(a, b int) int { return order.Compare(key(jobs[a].Job), key(jobs[b].Job)) })
			idx = idx[:r.Room()]
		}
		for _, i := range idx {
			jobs[i].Claim = true
		}
	}
	return rs
}

// reduceIntake makes a batch's jobs and dead letters (of source kind) of n
// job requests, as decode reads them: a request that does not decode is a
// dead letter; of several requests for one (type, key) the first wins and
// the others are duplicates when their job_data agree, else conflicts.
func reduceIntake(kind string, n int, decode func(i int) (store.Source, *correlator.Job, error)) (jobs []store.IntakeJob, dls []store.DeadLetter, dups int) {
	seen := make(map[[2]string]int, n) // (type, key) -> index in jobs
	jobs = make([]store.IntakeJob, 0, n)
	for i := range n {
		src, job, err := decode(i)
		if err != nil {
			dls = append(dls, store.DeadLetter{Kind: kind, Source: src, Reason: err.Error()})
			continue
		}
		k := [2]string{job.JobType, job.JobKey}
		if j, ok := seen[k]; ok {
			if sameJSON(jobs[j].Job.JobData, job.JobData) {
				dups++
			} else {
				dls = append(dls, store.DeadLetter{Kind: kind, Source: src,
					Reason: correlator.CodeConflict + ": an earlier request for this job_type and job_key has other job_data"})
			}
			continue
		}
		seen[k] = len(jobs)
		jobs = append(jobs, store.IntakeJob{Job: job, Source: src, Kind: kind})
	}
	return jobs, dls, dups
}

// decodeRecord checks the record's headers, then decodes its value and
// keeps what the headers say of the job (correlator.Job.TakeHeaders).
func decodeRecord(r *kgo.Record, src store.Source, maxBytes int, types correlator.Types, now time.Time) (*correlator.Job, error) {
	if err := correlator.CheckHeaders(src.Headers); err != nil {
		return nil, err
	}
	job, err := correlator.DecodeJob(r.Value, maxBytes, types, now)
	if err == nil {
		err = job.TakeHeaders(src.Headers, types.Get(job.JobType))
	}
	if err != nil {
		return nil, err
	}
	return job, nil
}

// sameJSON compares two JSON values semantically.
func sameJSON(a, b []byte) bool {
	if bytes.Equal(a, b) {
		return true
	}
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}

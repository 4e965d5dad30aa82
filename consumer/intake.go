package consumer

import (
	"bytes"
	"context"
	"encoding/json"
	"reflect"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// IntakeConfig configures the intake consumer.
type IntakeConfig struct {
	GroupConfig
	DeadLetterTopic string
	MaxBytes        int
	Types           map[string]*correlator.JobType
}

// Intake turns job requests read from the intake topics into jobs.
type Intake struct {
	*group
	cfg IntakeConfig
}

// NewIntake builds the intake consumer; Run starts it.
func NewIntake(log *zap.Logger, st *store.Store, cfg IntakeConfig) (*Intake, error) {
	in := &Intake{cfg: cfg}
	g, err := newGroup(log.Named("intake"), st, cfg.GroupConfig, in)
	if err != nil {
		return nil, err
	}
	in.group = g
	return in, nil
}

func (in *Intake) count(result string, n int) {
	if n > 0 {
		in.group.cfg.Metrics.IntakeRecords.WithLabelValues(metrics.SourceKafka, result).Add(float64(n))
	}
}

func (in *Intake) apply(ctx context.Context, recs []*kgo.Record, adv []store.OffsetAdvance) (func(), error) {
	now := time.Now()
	b := store.IntakeBatch{Group: in.cfg.Group, Offsets: adv}
	seen := map[[2]string]int{} // (type, key) -> index in b.Jobs
	dups := 0
	for _, r := range recs {
		src := source(r)
		job, err := decodeRecord(r, src, in.cfg.MaxBytes, in.cfg.Types, now)
		if err != nil {
			b.DeadLetters = append(b.DeadLetters, store.DeadLetter{Kind: store.SourceIntake, Source: src, Reason: err.Error()})
			continue
		}
		k := [2]string{job.JobType, job.JobKey}
		if i, ok := seen[k]; ok {
			// Several records for one key in a batch: the first wins.
			if sameJSON(b.Jobs[i].Job.JobData, job.JobData) {
				dups++
			} else {
				b.DeadLetters = append(b.DeadLetters, store.DeadLetter{Kind: store.SourceIntake, Source: src,
					Reason: correlator.CodeConflict + ": an earlier record for this job_type and job_key has other job_data"})
			}
			continue
		}
		seen[k] = len(b.Jobs)
		b.Jobs = append(b.Jobs, store.IntakeJob{Job: job, Source: src})
	}
	res, err := in.st.IntakeApply(ctx, b)
	if err != nil {
		return nil, err
	}
	return func() {
		in.count("accepted", res.Inserted)
		in.count("duplicate", res.Duplicates+dups)
		in.count("dead_lettered", len(res.DeadLetters))
		in.log.Debug("intake batch applied", zap.Int("records", len(recs)), zap.Int("accepted", res.Inserted),
			zap.Int("duplicates", res.Duplicates+dups), zap.Int("dead_lettered", len(res.DeadLetters)))
		in.copyDeadLetters(res.DeadLetters)
	}, nil
}

func (in *Intake) poison(ctx context.Context, rec *kgo.Record, adv []store.OffsetAdvance, cause error) (func(), error) {
	dl := store.DeadLetter{Kind: store.SourceIntake, Source: source(rec), Reason: correlator.CodeRejected + ": PostgreSQL refused it: " + correlator.Clip(cause.Error(), 1024)}
	res, err := in.st.IntakeApply(ctx, store.IntakeBatch{Group: in.cfg.Group, Offsets: adv, DeadLetters: []store.DeadLetter{dl}})
	if err != nil {
		return nil, err
	}
	return func() {
		in.count("dead_lettered", 1)
		in.copyDeadLetters(res.DeadLetters)
	}, nil
}

func (in *Intake) copyDeadLetters(dls []store.DeadLetter) {
	(&deadletter.Copier{Client: in.cl, Topic: in.cfg.DeadLetterTopic, Log: in.log}).Copy(dls)
}

// decodeRecord checks the record's headers, then decodes its value.
func decodeRecord(r *kgo.Record, src store.Source, maxBytes int, types map[string]*correlator.JobType, now time.Time) (*correlator.Job, error) {
	if err := correlator.CheckHeaders(src.Headers); err != nil {
		return nil, err
	}
	return correlator.DecodeJob(r.Value, maxBytes, types, now)
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

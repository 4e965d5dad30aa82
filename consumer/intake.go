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
	copyDeadLetters(in.log, in.cl, in.cfg.DeadLetterTopic, dls)
}

// copyDeadLetters sends a copy of each dead letter, after commit, to the
// dead-letter topic with a hipq-error header. PostgreSQL keeps the
// canonical copy, so a failed send is only logged.
func copyDeadLetters(log *zap.Logger, cl *kgo.Client, topic string, dls []store.DeadLetter) {
	for _, d := range dls {
		log.Warn("input dead-lettered", zap.String("source", d.Kind), zap.String("topic", d.Source.Topic),
			zap.Int32("partition", d.Source.Partition), zap.Int64("offset", d.Source.Offset), zap.String("reason", correlator.Clip(d.Reason, 1024)))
		if topic == "" {
			continue
		}
		r := &kgo.Record{Topic: topic, Key: d.Source.Key, Value: d.Source.Value}
		for _, h := range d.Source.Headers {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: correlator.HeaderError, Value: []byte(d.Reason)})
		cl.Produce(context.Background(), r, func(_ *kgo.Record, err error) {
			if err != nil {
				log.Warn("cannot copy dead letter to its topic; PostgreSQL keeps it", zap.String("topic", topic), zap.Error(err))
			}
		})
	}
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

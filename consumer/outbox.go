package consumer

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// OutboxConfig configures the outbox drainer.
type OutboxConfig struct {
	MaxBytes  int
	Types     correlator.Types
	BatchSize int           // rows per transaction; defaults to DefaultOutboxBatch
	Poll      time.Duration // looks this often without a notice; defaults to DefaultOutboxPoll
	Metrics   *metrics.Metrics
	// DeadLetters copies dead letters to the intake dead-letter topic.
	DeadLetters *deadletter.Copier
	// CrashPoint is a test hook: the process kills itself at the named
	// point (outbox:in-transaction); empty: never.
	CrashPoint string
	// Tracer, when set, records each dead letter that came in a trace as
	// a span there; nil: no tracing work.
	Tracer trace.Tracer
}

// Outbox drains hipq_intake, the transactional outbox: applications write
// job requests there inside their own transactions, and each row becomes
// a job (or a dead letter) exactly once, with the decoding, defaults,
// validation and duplicate rules of a Kafka intake record. It wakes on
// NOTIFY hipq_intake (a trigger on the table, sent at commit) and looks
// every Poll besides; several instances drain it at once, each taking rows
// the others do not hold.
type Outbox struct {
	log  *zap.Logger
	st   *store.Store
	cfg  OutboxConfig
	wake chan struct{}
	// batchBytes bounds what one drain transaction reads of the rows
	// (maxBatchBytes; tests lower it).
	batchBytes int
}

// NewOutbox builds the drainer; Run starts it.
func NewOutbox(log *zap.Logger, st *store.Store, cfg OutboxConfig) *Outbox {
	cfg.BatchSize = cmp.Or(cfg.BatchSize, DefaultOutboxBatch)
	cfg.Poll = cmp.Or(cfg.Poll, DefaultOutboxPoll)
	cfg.Metrics = metrics.Or(cfg.Metrics)
	return &Outbox{log: log.Named("outbox"), st: st, cfg: cfg, wake: make(chan struct{}, 1), batchBytes: maxBatchBytes}
}

// Run drains the outbox until ctx ends. PostgreSQL being unreachable only
// delays it: it tries again, backing off up to 5 s.
func (o *Outbox) Run(ctx context.Context) error {
	go o.listen(ctx)
	tick := time.NewTicker(o.cfg.Poll)
	defer tick.Stop()
	pause := 100 * time.Millisecond
	for {
		if _, err := o.Drain(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			o.log.Warn("cannot drain the outbox; trying again", zap.Duration("in", pause), zap.Error(err))
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(pause):
			}
			pause = min(2*pause, 5*time.Second)
			continue
		}
		pause = 100 * time.Millisecond
		select {
		case <-ctx.Done():
			return nil
		case <-o.wake:
		case <-tick.C:
		}
	}
}

// Drain applies batches until a batch finds no more rows this drainer may
// take (none left, or only rows other transactions hold), and returns how
// many rows it took.
func (o *Outbox) Drain(ctx context.Context) (int, error) {
	total := 0
	for {
		n, more, err := o.apply(ctx, nil)
		total += n
		if err != nil || !more {
			return total, err
		}
	}
}

// apply takes the rows ids names (nil: the oldest, a batch of them) and
// applies them in one transaction. Rows PostgreSQL refuses for any reason
// that is not passing (store.IsTransient) are split until the row at fault
// is found, and a row refused on its own is dead-lettered, so no input,
// however unforeseen, can stall the outbox.
//
// more says whether rows may be left that the drain may take: the batch
// was full, or stopped at its byte budget, or was split.
func (o *Outbox) apply(ctx context.Context, ids []int64) (n int, more bool, err error) {
	var dups int
	res, err := o.st.OutboxApply(ctx, o.take(ids, o.cfg.BatchSize), func(rows []store.OutboxRow) ([]store.IntakeJob, []store.DeadLetter) {
		var jobs []store.IntakeJob
		var dls []store.DeadLetter
		jobs, dls, dups = o.decide(rows)
		if o.cfg.CrashPoint == "outbox:in-transaction" {
			// Tests: die with the rows deleted in a transaction that never commits.
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
		return jobs, dls
	})
	taken := res.Taken
	if err == nil {
		o.applied(len(taken), res.IntakeResult, dups)
		return len(taken), res.More, nil
	}
	if store.IsTransient(err) || ctx.Err() != nil || len(taken) == 0 {
		return 0, false, err
	}
	if len(taken) > 1 {
		half := len(taken) / 2
		a, _, err := o.apply(ctx, taken[:half])
		if err != nil {
			return a, false, err
		}
		b, _, err := o.apply(ctx, taken[half:])
		return a + b, true, err
	}
	n, err = o.poison(ctx, taken[0], err)
	return n, true, err
}

// poison dead-letters one row PostgreSQL refused on its own. Should the
// dead letter be refused too (it keeps the row's headers), it is kept
// without them.
func (o *Outbox) poison(ctx context.Context, id int64, cause error) (int, error) {
	o.log.Warn("outbox row refused by PostgreSQL; dead-lettering it", zap.Int64("outbox_id", id),
		zap.String("error", correlator.Clip(cause.Error(), 1024)))
	reason := correlator.CodeRejected + ": PostgreSQL refused it: " + correlator.Clip(cause.Error(), 1024)
	dead := func(bare bool) store.OutboxDecide {
		return func(rows []store.OutboxRow) ([]store.IntakeJob, []store.DeadLetter) {
			var dls []store.DeadLetter
			for _, r := range rows {
				src, _ := outboxSource(r)
				if bare {
					src.Headers = nil
				}
				dls = append(dls, store.DeadLetter{Kind: store.SourceOutbox, Source: src, Reason: reason})
			}
			return nil, dls
		}
	}
	res, err := o.st.OutboxApply(ctx, o.take([]int64{id}, 1), dead(false))
	if err != nil && !store.IsTransient(err) && ctx.Err() == nil {
		o.log.Error("dead letter refused too; keeping it without its headers", zap.Int64("outbox_id", id), zap.Error(err))
		res, err = o.st.OutboxApply(ctx, o.take([]int64{id}, 1), dead(true))
	}
	if err != nil {
		return 0, err
	}
	o.applied(len(res.Taken), res.IntakeResult, 0)
	return len(res.Taken), nil
}

// maxBatchBytes bounds what one drain transaction reads of the rows.
const maxBatchBytes = 32 << 20

// take bounds a drain: a value is read up to one byte past intake's
// max_bytes and headers one past their limit (enough to refuse them as too
// large), and a batch stops at maxBatchBytes.
func (o *Outbox) take(ids []int64, limit int) store.OutboxTake {
	return store.OutboxTake{IDs: ids, Limit: limit, MaxValue: o.cfg.MaxBytes + 1,
		MaxHeaders: correlator.MaxHeaderBytes + 1, MaxBytes: o.batchBytes}
}

// decide makes jobs and dead letters of outbox rows, as intake does of
// Kafka records.
func (o *Outbox) decide(rows []store.OutboxRow) ([]store.IntakeJob, []store.DeadLetter, int) {
	now := time.Now()
	return reduceIntake(store.SourceOutbox, len(rows), func(i int) (store.Source, *correlator.Job, error) {
		r := rows[i]
		if r.HeadersSize > correlator.MaxHeaderBytes {
			src := store.Source{Value: r.Value, Received: r.CreatedAt}
			return src, nil, &correlator.InputError{Code: correlator.CodeTooLarge, Field: "headers",
				Detail: fmt.Sprintf("headers: %d bytes is more than the limit of %d", r.HeadersSize, correlator.MaxHeaderBytes)}
		}
		src, err := outboxSource(r)
		if err == nil && r.ValueSize > o.cfg.MaxBytes {
			// The value was read only in part: its dead letter keeps that part.
			err = &correlator.InputError{Code: correlator.CodeTooLarge,
				Detail: fmt.Sprintf("%d bytes is more than the limit of %d (the dead letter keeps the first %d)", r.ValueSize, o.cfg.MaxBytes, len(r.Value))}
		}
		if err == nil {
			err = correlator.CheckHeaders(src.Headers)
		}
		if err != nil {
			return src, nil, err
		}
		job, err := correlator.DecodeJob(rows[i].Value, o.cfg.MaxBytes, o.cfg.Types, now)
		if err == nil {
			job.Trace = correlator.TraceContextOf(src.Headers)
		}
		return src, job, err
	})
}

func (o *Outbox) applied(rows int, res store.IntakeResult, dups int) {
	if rows == 0 {
		return
	}
	count := func(result string, n int) {
		if n > 0 {
			o.cfg.Metrics.IntakeRecords.WithLabelValues(metrics.SourceOutbox, result).Add(float64(n))
		}
	}
	count("accepted", res.Inserted)
	count("duplicate", res.Duplicates+dups)
	count("dead_lettered", len(res.DeadLetters))
	o.log.Debug("outbox rows applied", zap.Int("rows", rows), zap.Int("accepted", res.Inserted),
		zap.Int("duplicates", res.Duplicates+dups), zap.Int("dead_lettered", len(res.DeadLetters)))
	o.cfg.DeadLetters.Copy(res.DeadLetters)
	traceDeadLetters(context.Background(), o.cfg.Tracer, res.DeadLetters)
}

// outboxSource is the dead-letter source of a row: its value, its headers
// (an error when the column is not a JSON object of string values; the
// source then has none) and when it was written.
func outboxSource(r store.OutboxRow) (store.Source, error) {
	src := store.Source{Value: r.Value, Received: r.CreatedAt}
	if r.Headers == nil {
		return src, nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(r.Headers, &m); err != nil {
		return src, &correlator.InputError{Code: correlator.CodeInvalidField, Field: "headers",
			Detail: "headers: " + correlator.Clip(string(r.Headers), 128) + " is not a JSON object of string values"}
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	hs := make([]correlator.Header, 0, len(keys))
	for _, k := range keys {
		var v string
		if err := json.Unmarshal(m[k], &v); err != nil {
			return src, &correlator.InputError{Code: correlator.CodeInvalidField, Field: "headers",
				Detail: "headers." + correlator.Clip(k, 64) + ": " + correlator.Clip(string(m[k]), 64) + " is not a string"}
		}
		hs = append(hs, correlator.Header{Key: k, Value: []byte(v)})
	}
	src.Headers = hs
	return src, nil
}

// listen turns the notices of rows committed to the outbox into
// wake-ups; polling stays the fallback.
func (o *Outbox) listen(ctx context.Context) {
	o.st.WaitIntake(ctx, o.poke, func(err error) {
		o.log.Debug("listen for outbox rows failed; polling meanwhile", zap.Error(err))
	})
}

func (o *Outbox) poke() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

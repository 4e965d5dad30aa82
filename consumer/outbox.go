package consumer

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
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
	// StallAfter is how long a row PostgreSQL refuses alone, for a reason
	// that is not plainly its own, waits for a row after it to be
	// compared with before the drainer is reported as stalled; it is
	// never dead-lettered for waiting (stall.go). Defaults to
	// DefaultStallAfter.
	StallAfter time.Duration
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
	stalls     *stalls

	mu   sync.Mutex
	hold *hold // the row the drainer waits on; nil: none
}

// NewOutbox builds the drainer; Run starts it.
func NewOutbox(log *zap.Logger, st *store.Store, cfg OutboxConfig) *Outbox {
	cfg.BatchSize = cmp.Or(cfg.BatchSize, DefaultOutboxBatch)
	cfg.Poll = cmp.Or(cfg.Poll, DefaultOutboxPoll)
	cfg.Metrics = metrics.Or(cfg.Metrics)
	cfg.StallAfter = cmp.Or(cfg.StallAfter, DefaultStallAfter)
	log = log.Named("outbox")
	return &Outbox{log: log, st: st, cfg: cfg, wake: make(chan struct{}, 1), batchBytes: maxBatchBytes,
		stalls: newStalls("outbox", log, cfg.Metrics)}
}

// Run drains the outbox until ctx ends. PostgreSQL being unreachable only
// delays it: it tries again, backing off up to 5 s. A drain held on a row
// PostgreSQL refused for a reason that may not be the row's own (stall.go)
// is tried again when its hold's backoff passes.
func (o *Outbox) Run(ctx context.Context) error {
	go o.listen(ctx)
	tick := time.NewTicker(o.cfg.Poll)
	defer tick.Stop()
	pause := 100 * time.Millisecond
	for {
		_, err := o.Drain(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case errors.Is(err, errHeld):
			sleep(ctx, time.Until(o.heldUntil()))
			continue
		case err != nil:
			o.log.Warn("cannot drain the outbox; trying again", zap.Duration("in", pause), zap.Error(err))
			sleep(ctx, pause)
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

// errHeld: a drain stopped at a row PostgreSQL refused alone for a reason
// that may not be the row's own; it is tried again after a backoff.
var errHeld = errors.New("the outbox waits on a row PostgreSQL refused")

// Drain applies batches until a batch finds no more rows this drainer may
// take (none left, or only rows other transactions hold), and returns how
// many rows it took. A row PostgreSQL refuses alone for a reason that may
// not be its own stops the drain there (errHeld).
func (o *Outbox) Drain(ctx context.Context) (int, error) {
	total := 0
	for {
		var dups int
		b := &batchRead{rows: map[int64]rowRead{}}
		res, err := o.st.OutboxApply(ctx, o.take(nil, o.cfg.BatchSize), o.decider(&dups, nil, false, b))
		n, more := len(res.Taken), res.More
		switch {
		case err == nil:
			// PostgreSQL takes rows (or there are none): nothing to wait on.
			o.applied(n, res.IntakeResult, dups)
			o.release()
		case refusedBy(ctx, err) && n > 0:
			b.ids = res.Taken
			n, err = o.split(ctx, b, res.Taken, err)
			more = true
		default:
			n = 0
		}
		total += n
		if err != nil || !more {
			return total, err
		}
	}
}

// batchRead is a batch PostgreSQL refused: the ids of its rows, and what
// each decoded to when the batch was decided.
type batchRead struct {
	ids  []int64
	rows map[int64]rowRead
}

// rowRead is what an outbox row decoded to.
type rowRead struct {
	job   bool   // a job request (not a dead letter)
	input string // of a job request: its type and key
}

// split applies the rows ids names, a part of the batch b that PostgreSQL
// refused with cause, halving them until the row at fault is found
// (refused).
func (o *Outbox) split(ctx context.Context, b *batchRead, ids []int64, cause error) (int, error) {
	if len(ids) == 1 {
		return o.refused(ctx, b, ids[0], cause)
	}
	n := 0
	for _, part := range [][]int64{ids[:len(ids)/2], ids[len(ids)/2:]} {
		var dups int
		res, err := o.st.OutboxApply(ctx, o.take(part, len(part)), o.decider(&dups, nil, false, nil))
		switch {
		case err == nil:
			o.applied(len(res.Taken), res.IntakeResult, dups)
			o.passed(res.Taken)
			n += len(res.Taken)
			continue
		case refusedBy(ctx, err) && len(res.Taken) > 0:
			m, err := o.split(ctx, b, res.Taken, err)
			n += m
			if err == nil {
				continue
			}
			return n, err
		}
		return n, err
	}
	return n, nil
}

// refused decides for row id, refused alone with cause, within the batch
// b (see stall.go): a refusal of its data dead-letters it; any other is
// compared with the next row of b that makes a job and is another
// request, taken with it and written first in one transaction, the row
// (and the copies of its request between them) tried again after it:
// dead-lettered if refused again, else written (the refusal had stopped
// between the tries). The
// other rows between them write nothing (dead letters, or requests for
// jobs that exist): they are left for the drain, as any row.
func (o *Outbox) refused(ctx context.Context, b *batchRead, id int64, cause error) (int, error) {
	if store.IsDataError(cause) {
		return o.poison(ctx, id, cause)
	}
	own, known := b.rows[id]
	refusals := []rowRefusal{{id: id, cause: cause}}
	i := slices.Index(b.ids, id)
	for _, next := range b.ids[i+1:] {
		r, ok := b.rows[next]
		switch {
		case i < 0 || ok && !r.job:
			continue
		case known && own.job && ok && r.input == own.input:
			// A copy of its request shows nothing: it would be refused
			// for its own fault just the same.
			refusals = append(refusals, rowRefusal{id: next,
				cause: fmt.Errorf("the same request as outbox row %d, refused alone: %w", id, cause)})
			continue
		}
		// (A row the batch never decided, refused before its decision,
		// may write: it is tried.) A request for a job that exists writes
		// nothing: it rolls back (store.ErrNoWrite) and the next is tried.
		var dups int
		ids := []int64{next}
		for _, f := range refusals {
			ids = append(ids, f.id)
		}
		slices.Sort(ids)
		t := o.take(ids, len(ids))
		t.All, t.MustWrite = true, true
		res, err := o.st.OutboxApply(ctx, t, o.decider(&dups, refusals, true, nil))
		switch {
		case errors.Is(err, store.ErrNoWrite):
			continue
		case err == nil && len(res.Taken) > 0 && res.RefusedAgain == nil:
			o.log.Info("outbox row refused alone went through when tried again after the row after it: the refusal had stopped",
				zap.Int64("outbox_id", id), zap.String("sqlstate", reason(cause)))
			o.applied(len(res.Taken), res.IntakeResult, dups)
			o.passed(res.Taken)
			return len(res.Taken), nil
		case err == nil && len(res.Taken) > 0:
			// The refusal was the row's own.
			for _, f := range refusals {
				o.logDeadLetter(f.id, res.RefusedAgain, "the row after it went through, and it was refused again after it")
			}
			o.applied(len(res.Taken), res.IntakeResult, dups)
			o.passed(res.Taken)
			return len(res.Taken), nil
		case err == nil:
			// Nothing taken: another drainer holds one of the rows (it
			// took the row after it, say); the next is tried.
			continue
		case !refusedBy(ctx, err):
			return 0, err
		case store.SameRefusal(cause, err):
			o.holdAt(id, err, true)
			return 0, fmt.Errorf("outbox row %d: %w", id, errHeld)
		default:
			// The row after it was refused otherwise: the refusal was the
			// row's own.
			return o.poison(ctx, id, cause)
		}
	}
	// No row after it to compare with: the drain waits on it until one
	// comes or the refusal stops, never dead-lettering it for waiting.
	o.holdAt(id, cause, false)
	return 0, fmt.Errorf("outbox row %d: %w", id, errHeld)
}

// rowRefusal is a row PostgreSQL refused on its own, to be dead-lettered.
type rowRefusal struct {
	id    int64
	cause error
	bare  bool // without its headers: its dead letter was refused with them
}

// decider makes jobs and dead letters of a drain's rows: the rows of
// refused are dead-lettered with their refusals (with again, only should
// they be refused again once the others are written: store.IntakeRetry),
// the others are decided, and what each decoded to is kept in read (when
// set).
func (o *Outbox) decider(dups *int, refused []rowRefusal, again bool, read *batchRead) store.OutboxDecide {
	return func(rows []store.OutboxRow) (store.OutboxDecision, error) {
		var d store.OutboxDecision
		var tried []store.OutboxRow
		if len(refused) > 0 {
			rows = slices.DeleteFunc(slices.Clone(rows), func(r store.OutboxRow) bool {
				k := slices.IndexFunc(refused, func(f rowRefusal) bool { return f.id == r.ID })
				if k < 0 {
					return false
				}
				src, _ := outboxSource(r)
				if refused[k].bare {
					src.Headers = nil
				}
				dl := store.DeadLetter{Kind: store.SourceOutbox, Source: src, Reason: rejected(refused[k].cause)}
				if again {
					if d.Retry == nil {
						d.Retry = &store.IntakeRetry{}
					}
					d.Retry.Refused = append(d.Retry.Refused, dl)
					tried = append(tried, r)
				} else {
					d.DeadLetters = append(d.DeadLetters, dl)
				}
				return true
			})
		}
		jobs, dls, n := o.decide(rows, read)
		*dups = n
		if d.Retry != nil {
			d.Retry.Jobs, d.Retry.DeadLetters, d.Retry.Duplicates = o.decide(tried, nil)
		}
		if o.cfg.CrashPoint == "outbox:in-transaction" {
			// Tests: die with the rows deleted in a transaction that never commits.
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
		d.Jobs, d.DeadLetters = jobs, append(dls, d.DeadLetters...)
		return d, nil
	}
}

// poison dead-letters one row PostgreSQL refused on its own. Should the
// dead letter be refused too (it keeps the row's headers), it is kept
// without them. Should that be refused too, for a reason that is not its
// data (the dead-letter table broken), the drain is held on the row as on
// a systemic refusal (errHeld).
func (o *Outbox) poison(ctx context.Context, id int64, cause error) (int, error) {
	// Held on its dead letter, a row is tried again quietly: the stall is
	// logged once a minute.
	o.mu.Lock()
	held := o.hold != nil && o.hold.at == id && o.hold.onDeadLetter
	o.mu.Unlock()
	if !held {
		o.logDeadLetter(id, cause, "")
	}
	var dups int
	res, err := o.st.OutboxApply(ctx, o.take([]int64{id}, 1), o.decider(&dups, []rowRefusal{{id: id, cause: cause}}, false, nil))
	if refusedBy(ctx, err) {
		if !held {
			o.log.Error("dead letter refused too; keeping it without its headers", zap.Int64("outbox_id", id), zap.Error(err))
		}
		res, err = o.st.OutboxApply(ctx, o.take([]int64{id}, 1), o.decider(&dups, []rowRefusal{{id: id, cause: cause, bare: true}}, false, nil))
		if refusedBy(ctx, err) && !store.IsDataError(err) {
			o.holdAt(id, err, true)
			o.mu.Lock()
			o.hold.onDeadLetter = true
			o.mu.Unlock()
			return 0, fmt.Errorf("outbox row %d: %w", id, errHeld)
		}
	}
	if err != nil {
		return 0, err
	}
	o.applied(len(res.Taken), res.IntakeResult, 0)
	o.passed(res.Taken)
	return len(res.Taken), nil
}

func (o *Outbox) logDeadLetter(id int64, cause error, why string) {
	fields := []zap.Field{zap.Int64("outbox_id", id), zap.String("sqlstate", reason(cause)),
		zap.String("error", correlator.Clip(cause.Error(), 1024))}
	if why != "" {
		fields = append(fields, zap.String("because", why))
	}
	o.log.Warn("outbox row refused by PostgreSQL; dead-lettering it", fields...)
}

// holdAt makes the drainer wait on row id until a backoff passes.
func (o *Outbox) holdAt(id int64, cause error, systemic bool) {
	now := time.Now()
	o.mu.Lock()
	if o.hold == nil || o.hold.at != id {
		o.hold = &hold{at: id, since: now}
		if !systemic {
			o.log.Warn("outbox row refused alone; the drain waits for a row after it to tell whether the refusal is the row's own",
				zap.Int64("outbox_id", id), zap.String("sqlstate", reason(cause)), zap.String("error", correlator.Clip(cause.Error(), 1024)))
		}
	}
	o.hold.refused(cause, systemic, now)
	o.mu.Unlock()
	o.reportStalls()
}

// heldUntil is when the row the drainer waits on is tried again.
func (o *Outbox) heldUntil() time.Time {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.hold == nil {
		return time.Now()
	}
	return o.hold.until
}

// passed lets go of the hold when its row was taken (applied or
// dead-lettered) by a committed transaction.
func (o *Outbox) passed(taken []int64) {
	o.mu.Lock()
	held := o.hold != nil && slices.Contains(taken, o.hold.at)
	o.mu.Unlock()
	if held {
		o.release()
	}
}

// release lets go of the hold: PostgreSQL takes rows again, or the row
// waited on is gone (another drainer took it).
func (o *Outbox) release() {
	o.mu.Lock()
	had := o.hold != nil
	o.hold = nil
	o.mu.Unlock()
	if had {
		o.reportStalls()
	}
}

func (o *Outbox) reportStalls() {
	var now []stalled
	o.mu.Lock()
	if h := o.hold; h != nil && h.stalls(o.cfg.StallAfter) {
		now = append(now, stalled{where: fmt.Sprintf("outbox row %d", h.at), err: h.err})
	}
	o.mu.Unlock()
	o.stalls.set(now)
}

// Stalled is nil while the drainer does not wait on a refusal that is not
// the rows' own, else what it waits on and why (readiness).
func (o *Outbox) Stalled() error { return o.stalls.err() }

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
// Kafka records, and keeps what each row decoded to in read (when set).
func (o *Outbox) decide(rows []store.OutboxRow, read *batchRead) ([]store.IntakeJob, []store.DeadLetter, int) {
	now := time.Now()
	return reduceIntake(store.SourceOutbox, len(rows), func(i int) (store.Source, *correlator.Job, error) {
		src, job, err := o.decodeRow(rows[i], now)
		if read != nil {
			read.rows[rows[i].ID] = rowRead{}
			if job != nil {
				read.rows[rows[i].ID] = rowRead{job: true, input: job.JobType + "\x00" + job.JobKey}
			}
		}
		return src, job, err
	})
}

// decodeRow reads one outbox row as a job request.
func (o *Outbox) decodeRow(r store.OutboxRow, now time.Time) (store.Source, *correlator.Job, error) {
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
	job, err := correlator.DecodeJob(r.Value, o.cfg.MaxBytes, o.cfg.Types, now)
	if err == nil {
		err = job.TakeHeaders(src.Headers, o.cfg.Types.Get(job.JobType))
	}
	if err != nil {
		return src, nil, err
	}
	return src, job, nil
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

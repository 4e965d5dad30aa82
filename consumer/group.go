// Package consumer runs hipq's two Kafka consumer groups: intake (job
// requests become jobs) and responses (replies resolve jobs).
//
// Both apply each record exactly once (invariant 7). The offset of every
// partition lives in PostgreSQL, written in the same transaction as the
// records' effects as a compare-and-set against the offset this consumer
// last read from or wrote there. On assignment the consumer seeks to the
// stored offsets, so a record re-read after a crash, or applied meanwhile
// by an instance that took the partition over, never takes effect twice:
// the compare-and-set fails, the transaction rolls back and the consumer
// seeks to the stored offset. After its transaction the consumer also
// marks the offsets for commit to the Kafka group, so lag tools see them;
// on assignment PostgreSQL's offsets win.
package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
)

// Start is where a partition with no stored offset begins.
type Start string

// Starts.
const (
	StartEarliest Start = "earliest" // the default
	StartLatest   Start = "latest"
)

// Defaults of the consumers' configs.
const (
	DefaultStart          = StartEarliest
	DefaultSessionTimeout = 10 * time.Second
	// DefaultMaxPollRecords bounds a poll, so a batch (one transaction):
	// batches of 1,000 records run as fast as batches of 5,000, and the
	// process holds a fifth of the decoded records at once.
	DefaultMaxPollRecords = 1000
	DefaultEarlyTTL       = 10 * time.Minute
	DefaultOutboxBatch    = 1000
	DefaultOutboxPoll     = time.Second
)

// GroupConfig is one consumer group.
type GroupConfig struct {
	Kafka          kafkaconn.Config
	Group          string
	Topics         []string
	Start          Start         // defaults to DefaultStart
	SessionTimeout time.Duration // defaults to DefaultSessionTimeout
	// ReadUncommitted reads the records of aborted transactions too; by
	// default only committed records are read.
	ReadUncommitted bool
	MaxPollRecords  int // defaults to DefaultMaxPollRecords
	// Metrics receives the consumer's counts and lag; nil = not served.
	Metrics *metrics.Metrics
	// CrashPoint is a test hook: the process kills itself at the named
	// point ({group}:after-commit); empty: never.
	CrashPoint string
	// Tracer, when set, traces what the group applies: replies as
	// children of their attempts' send spans, dead letters in their own
	// traces; nil: no tracing work.
	Tracer trace.Tracer
	// StallAfter is how long a record PostgreSQL refuses alone, for a
	// reason that is not plainly its own, waits for a record after it to
	// be compared with before its partition is reported as stalled
	// (hipq_consumer_stalled, readiness); it is never dead-lettered for
	// waiting (stall.go). Defaults to DefaultStallAfter.
	StallAfter time.Duration
	// FetchMaxBytes, FetchMaxPartitionBytes and MaxConcurrentFetches
	// bound what the group's client fetches and holds until it is polled
	// (franz-go's options of these names): at most MaxConcurrentFetches
	// fetches in flight or buffered, of FetchMaxBytes each (a first batch
	// larger still comes). 0 keeps franz-go's default: 50 MiB a fetch,
	// 1 MiB a partition, a fetch per broker at once.
	FetchMaxBytes          int32
	FetchMaxPartitionBytes int32
	MaxConcurrentFetches   int
	// MaxBufferedBytes bounds the dead-letter copies the group's client
	// holds unsent (kgo.MaxBufferedBytes): a copy waits for room. 0:
	// unbounded.
	MaxBufferedBytes int64
	// MaxDecompressBatchBytes bounds one fetched batch decompressed
	// (kgo.MaxDecompressBatchBytes). A batch past it is never read: its
	// offsets are dead-lettered too_large and the partition is read on
	// after it (skipBatch). 0 keeps franz-go's default, 1 GiB.
	MaxDecompressBatchBytes int
}

// fetchOpts are the franz-go options of the bounds set in c.
func (c GroupConfig) fetchOpts() []kgo.Opt {
	var opts []kgo.Opt
	if c.FetchMaxBytes > 0 {
		opts = append(opts, kgo.FetchMaxBytes(c.FetchMaxBytes))
	}
	if c.FetchMaxPartitionBytes > 0 {
		opts = append(opts, kgo.FetchMaxPartitionBytes(c.FetchMaxPartitionBytes))
	}
	if c.MaxConcurrentFetches > 0 {
		opts = append(opts, kgo.MaxConcurrentFetches(c.MaxConcurrentFetches))
	}
	if c.MaxBufferedBytes > 0 {
		opts = append(opts, kgo.MaxBufferedBytes(int(c.MaxBufferedBytes)))
	}
	if c.MaxDecompressBatchBytes > 0 {
		opts = append(opts, kgo.MaxDecompressBatchBytes(c.MaxDecompressBatchBytes))
	}
	return opts
}

// WithDefaults returns c with every unset field at its default.
func (c GroupConfig) WithDefaults() GroupConfig {
	c.Start = cmp.Or(c.Start, DefaultStart)
	c.SessionTimeout = cmp.Or(c.SessionTimeout, DefaultSessionTimeout)
	c.MaxPollRecords = cmp.Or(c.MaxPollRecords, DefaultMaxPollRecords)
	c.Metrics = metrics.Or(c.Metrics)
	c.StallAfter = cmp.Or(c.StallAfter, DefaultStallAfter)
	return c
}

// rebalanceTimeout bounds how long members may take to rejoin the group.
func (c GroupConfig) rebalanceTimeout() time.Duration { return max(3*c.SessionTimeout, 10*time.Second) }

// applier writes one batch of records, with their offset advances, in one
// transaction: the effects of recs and the dead letters of refused. after
// runs once it committed (dead-letter copies, logs). With compare (a
// record refused alone compared with the records after it, refused),
// recs must make a job or apply a reply (move a deadline), else nothing is
// written and the error is store.ErrNoWrite; and refused are tried again
// after recs, in the same transaction, and dead-lettered only if refused
// again (again says why; nil: they went through, the refusal had stopped
// between their tries).
type applier interface {
	apply(ctx context.Context, recs []*kgo.Record, refused []refusal, adv []store.OffsetAdvance, compare bool) (after func(), again, err error)
	// input is what rec asks for, as decoded: nil when it decodes to a
	// dead letter only; else the names of what it writes (a job's type
	// and key; a reply's job id and attempt, its job's type, key and
	// attempt), of which two records of the same input share one. Only
	// a record that decodes may show whether the write a record before
	// it was refused goes through, and only if it does write (mustWrite):
	// a duplicate request, or a reply that turns out duplicate, stale or
	// for a type not configured, writes nothing. A record of the same
	// input shows nothing either: it would be refused for its own fault
	// just the same.
	input(rec *kgo.Record) []string
}

// sameInput reports whether two records' inputs (applier.input) are the
// same: they share a name.
func sameInput(a, b []string) bool {
	for _, x := range a {
		if slices.Contains(b, x) {
			return true
		}
	}
	return false
}

// refusal is a record PostgreSQL refused on its own, to be dead-lettered
// (reason rejected) with why.
type refusal struct {
	rec   *kgo.Record
	cause error
	bare  bool // without its headers: its dead letter was refused with them
	// reason, when set, is the dead letter's reason as it is, in place
	// of cause's (a refusal that is not PostgreSQL's: a batch never read).
	reason string
}

// recsOf is the records of refused.
func recsOf(refused []refusal) []*kgo.Record {
	recs := make([]*kgo.Record, len(refused))
	for i, r := range refused {
		recs[i] = r.rec
	}
	return recs
}

// deadLetters are the dead letters of refused, of kind.
func deadLetters(refused []refusal, kind string) []store.DeadLetter {
	var dls []store.DeadLetter
	for _, r := range refused {
		dls = append(dls, r.deadLetter(kind))
	}
	return dls
}

// deadLetter is the dead letter of a refused record.
func (r refusal) deadLetter(kind string) store.DeadLetter {
	src := source(r.rec)
	if r.bare {
		src.Headers = nil
	}
	if r.reason != "" {
		return store.DeadLetter{Kind: kind, Source: src, Reason: r.reason}
	}
	return store.DeadLetter{Kind: kind, Source: src, Reason: rejected(r.cause)}
}

// group is the exactly-once loop shared by intake and responses.
type group struct {
	log *zap.Logger
	st  *store.Store
	cfg GroupConfig
	cl  *kgo.Client
	app applier

	mu  sync.Mutex
	pos map[store.TopicPartition]int64 // stored next offset; -1: none stored
	// holds are the partitions waiting on a record PostgreSQL refused
	// alone for a reason that may not be the record's own (stall.go).
	holds  map[store.TopicPartition]*hold
	stalls *stalls
	// skips are the batches too large to decompress that wait to be
	// dead-lettered (skipBatch), by partition: franz-go fetches none of
	// those partitions until they are sought past them.
	skips map[store.TopicPartition]*skip
}

// skip is a batch franz-go would not decompress, waiting to be
// dead-lettered, and when to try next.
type skip struct {
	e     *kgo.ErrDecompressTooLarge
	tries int       // writes that failed
	at    time.Time // the next try
	since time.Time // the first failed write
	err   error     // the last one's error
}

// copyDeliveryTimeout bounds how long a dead-letter copy is retried.
const copyDeliveryTimeout = 30 * time.Second

func newGroup(log *zap.Logger, st *store.Store, cfg GroupConfig, app applier) (*group, error) {
	cfg = cfg.WithDefaults()
	g := &group{log: log, st: st, cfg: cfg, app: app, pos: map[store.TopicPartition]int64{},
		holds: map[store.TopicPartition]*hold{}, stalls: newStalls(cfg.Group, log, cfg.Metrics), skips: map[store.TopicPartition]*skip{}}
	reset := kgo.NewOffset().AtStart()
	if cfg.Start == StartLatest {
		reset = kgo.NewOffset().AtEnd()
	}
	opts := []kgo.Opt{
		kgo.ConsumerGroup(cfg.Group),
		kgo.ConsumeTopics(cfg.Topics...),
		kgo.ConsumeResetOffset(reset),
		kgo.BlockRebalanceOnPoll(),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(time.Second),
		kgo.AdjustFetchOffsetsFn(g.adjust),
		kgo.OnPartitionsRevoked(g.forget),
		kgo.OnPartitionsLost(g.forget),
		kgo.FetchMaxWait(500 * time.Millisecond),
		// The group's client also writes its dead-letter copies: one a
		// topic never takes gives up, so that its buffer empties.
		kgo.RecordDeliveryTimeout(copyDeliveryTimeout),
	}
	opts = append(opts, cfg.fetchOpts()...)
	if !cfg.ReadUncommitted {
		opts = append(opts, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	}
	// The rebalance timeout bounds how long members may take to rejoin:
	// one batch's transaction, seconds at most. A short one lets a group
	// get past members that died without leaving (SIGKILL) soon after
	// their sessions expire, instead of waiting kgo's default minute.
	//
	// Heartbeats go at most a third of the session timeout apart, as
	// Kafka's own consumer documents: at the client's default 3s a
	// session of 3s would expire between two of them.
	opts = append(opts, kgo.SessionTimeout(cfg.SessionTimeout), kgo.RebalanceTimeout(cfg.rebalanceTimeout()),
		kgo.HeartbeatInterval(min(cfg.SessionTimeout/3, 3*time.Second)))
	cl, err := kafkaconn.NewClient(cfg.Kafka, log, opts...)
	if err != nil {
		return nil, err
	}
	g.cl = cl
	cfg.Metrics.ReportLag(cfg.Group, g.lag)
	return g, nil
}

// adjust replaces the group's committed offsets of newly assigned
// partitions with PostgreSQL's. franz-go asks it not to outlast the
// rebalance timeout, so it tries for half of that at most: past it, its
// error makes the client rejoin the group and ask again, and no partition
// is ever read from any offset but PostgreSQL's.
func (g *group) adjust(ctx context.Context, offsets map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
	ctx, cancel := context.WithTimeout(ctx, g.cfg.rebalanceTimeout()/2)
	defer cancel()
	var tps []store.TopicPartition
	for t, ps := range offsets {
		for p := range ps {
			tps = append(tps, store.TopicPartition{Topic: t, Partition: p})
		}
	}
	var stored map[store.TopicPartition]int64
	var err error
	for try := 0; ; try++ {
		stored, err = g.st.OffsetsLoad(ctx, g.cfg.Group, tps)
		if err == nil || ctx.Err() != nil || !store.IsTransient(err) {
			break
		}
		g.log.Warn("cannot load stored offsets; retrying", zap.String("group", g.cfg.Group), zap.Error(err))
		sleep(ctx, backoff(try))
	}
	if err != nil {
		g.log.Error("cannot load stored offsets; rejoining the group to try again", zap.String("group", g.cfg.Group), zap.Error(err))
		return nil, fmt.Errorf("load stored offsets of group %s: %w", g.cfg.Group, err)
	}
	reset := kgo.NewOffset().AtStart()
	if g.cfg.Start == StartLatest {
		reset = kgo.NewOffset().AtEnd()
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, tp := range tps {
		if next, ok := stored[tp]; ok {
			offsets[tp.Topic][tp.Partition] = kgo.NewOffset().At(next).WithEpoch(-1)
			g.pos[tp] = next
		} else {
			offsets[tp.Topic][tp.Partition] = reset
			g.pos[tp] = -1
		}
	}
	g.log.Info("partitions assigned", zap.String("group", g.cfg.Group), zap.Int("partitions", len(tps)))
	return offsets, nil
}

// forget drops what the group knew of partitions it lost; a partition
// paused on a hold is resumed (a pause outlives the assignment), so that
// it is read again should it come back.
func (g *group) forget(_ context.Context, cl *kgo.Client, lost map[string][]int32) {
	g.mu.Lock()
	held := false
	for t, ps := range lost {
		for _, p := range ps {
			tp := store.TopicPartition{Topic: t, Partition: p}
			delete(g.pos, tp)
			delete(g.skips, tp)
			if _, ok := g.holds[tp]; ok {
				delete(g.holds, tp)
				held = true
			}
		}
	}
	g.mu.Unlock()
	if held && cl != nil {
		cl.ResumeFetchPartitions(lost)
		g.reportStalls()
	}
}

// lag is, for each partition assigned here, the records between its end
// offset and the next offset to apply; a partition with no stored offset
// counts from its start (from its end with start: latest). Asked at
// scrape time: a partition with no new records is reported too.
func (g *group) lag(ctx context.Context) ([]metrics.PartitionLag, error) {
	g.mu.Lock()
	pos := maps.Clone(g.pos)
	g.mu.Unlock()
	if len(pos) == 0 {
		return nil, nil
	}
	var topics []string
	fromStart := false
	for tp, next := range pos {
		if !slices.Contains(topics, tp.Topic) {
			topics = append(topics, tp.Topic)
		}
		fromStart = fromStart || (next < 0 && g.cfg.Start != StartLatest)
	}
	adm := kadm.NewClient(g.cl)
	ends, err := adm.ListEndOffsets(ctx, topics...)
	if err != nil {
		return nil, err
	}
	var starts kadm.ListedOffsets
	if fromStart {
		if starts, err = adm.ListStartOffsets(ctx, topics...); err != nil {
			return nil, err
		}
	}
	var out []metrics.PartitionLag
	for tp, next := range pos {
		end, ok := ends.Lookup(tp.Topic, tp.Partition)
		if !ok || end.Err != nil {
			continue
		}
		if next < 0 && g.cfg.Start == StartLatest {
			next = end.Offset
		} else if next < 0 {
			start, ok := starts.Lookup(tp.Topic, tp.Partition)
			if !ok || start.Err != nil {
				continue
			}
			next = start.Offset
		}
		out = append(out, metrics.PartitionLag{Topic: tp.Topic, Partition: tp.Partition, Records: max(end.Offset-next, 0)})
	}
	return out, nil
}

// Run polls and applies until ctx ends, then leaves the group.
func (g *group) Run(ctx context.Context) error {
	defer g.cl.Close()
	failures := 0
	for {
		// A poll lasts until the first held partition is due again.
		pollCtx, cancel := ctx, context.CancelFunc(func() {})
		if at, ok := g.nextDue(); ok {
			pollCtx, cancel = context.WithDeadline(ctx, at)
		}
		fetches := g.cl.PollRecords(pollCtx, g.cfg.MaxPollRecords)
		cancel()
		if fetches.IsClientClosed() || ctx.Err() != nil {
			g.cl.AllowRebalance()
			return nil
		}
		fetches.EachError(func(t string, p int32, err error) {
			if e, ok := errors.AsType[*kgo.ErrDecompressTooLarge](err); ok {
				tp := store.TopicPartition{Topic: e.Topic, Partition: e.Partition}
				g.mu.Lock()
				if s := g.skips[tp]; s == nil || s.e.Offset != e.Offset { // (the same batch met again keeps its backoff)
					g.skips[tp] = &skip{e: e}
				}
				g.mu.Unlock()
				return
			}
			if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				g.log.Warn("fetch error", zap.String("group", g.cfg.Group), zap.String("topic", t), zap.Int32("partition", p), zap.Error(err))
			}
		})
		// Between a poll and AllowRebalance no partition is revoked: the
		// held partitions due again are sought and resumed here.
		g.resumeDue()
		g.skipDue(context.WithoutCancel(ctx))
		recs := g.fresh(fetches.Records())
		if len(recs) > 0 {
			if err := g.process(context.WithoutCancel(ctx), recs); err != nil {
				failures++
				g.log.Error("cannot apply records; will read them again", zap.String("group", g.cfg.Group),
					zap.Int("records", len(recs)), zap.Int("failures", failures), zap.String("error", correlator.Clip(err.Error(), 2048)))
				g.reseek(recs)
				g.cl.AllowRebalance()
				sleep(ctx, backoff(failures))
				continue
			}
			failures = 0
		}
		g.cl.AllowRebalance()
	}
}

// skipDue tries the skips whose time has come (skipBatch); one that
// fails is tried again later, longer each time, its partition unread
// meanwhile, and is reported as stalled once it has failed for
// StallAfter.
func (g *group) skipDue(ctx context.Context) {
	now := time.Now()
	g.mu.Lock()
	var due []*skip
	for _, s := range g.skips {
		if !s.at.After(now) {
			due = append(due, s)
		}
	}
	g.mu.Unlock()
	failed := false
	for _, s := range due {
		e := s.e
		done, err := g.skipBatch(ctx, e, s.tries == 0)
		tp := store.TopicPartition{Topic: e.Topic, Partition: e.Partition}
		g.mu.Lock()
		if g.skips[tp] == s {
			switch {
			case done:
				delete(g.skips, tp)
				failed = failed || s.tries > 0
			case err != nil:
				if s.tries == 0 {
					s.since = time.Now()
				}
				s.tries++
				s.err = err
				failed = true
				fallthrough
			default:
				s.at = time.Now().Add(backoff(s.tries + 1))
			}
		}
		g.mu.Unlock()
		if err != nil {
			g.log.Error("cannot dead-letter a batch too large to read; will try again", zap.String("group", g.cfg.Group),
				zap.String("topic", e.Topic), zap.Int32("partition", e.Partition), zap.Int64("offset", e.Offset),
				zap.Int("tries", s.tries), zap.String("error", correlator.Clip(err.Error(), 2048)))
		}
	}
	if failed {
		g.reportStalls()
	}
}

// skipBatch dead-letters the batch e names, which decompresses to more
// than the group's MaxDecompressBatchBytes and so is never read (franz-go
// stops fetching its partition there), and moves the partition's stored
// offset past it in the same transaction (compare-and-set, as every
// write of the group): one dead letter too_large naming its offsets,
// kept like any other, then the partition sought past it and read on.
// What lies between the stored offset and the batch holds no record to
// apply (franz-go returns the records before a batch it cannot read
// first, without the error): transaction markers, aborted or compacted
// records. It reports whether the skip is settled: done (or no longer
// this instance's to do), or to be tried again (a write that failed, an
// offset another consumer moved, a partition held on a record before
// the batch, which is settled first).
func (g *group) skipBatch(ctx context.Context, e *kgo.ErrDecompressTooLarge, first bool) (bool, error) {
	tp := store.TopicPartition{Topic: e.Topic, Partition: e.Partition}
	g.mu.Lock()
	from, known := g.pos[tp] // (-1: none stored)
	held := g.holds[tp] != nil
	g.mu.Unlock()
	// A seek to past the batch: never the position franz-go stopped at
	// (the batch's own offset, or before it), and the partition's entry
	// made first (franz-go skips a seek of a partition it has none for: no
	// offset stored, nothing polled), by a mark of the offset before.
	seekPast := func(to int64, epoch int32) {
		g.cl.MarkCommitRecords(&kgo.Record{Topic: e.Topic, Partition: e.Partition, Offset: to - 1, LeaderEpoch: epoch})
		g.cl.SetOffsets(map[string]map[int32]kgo.EpochOffset{e.Topic: {e.Partition: {Epoch: epoch, Offset: to}}})
	}
	switch {
	case !known:
		return true, nil // (revoked: its next owner meets the batch)
	case held:
		return false, nil
	case from >= e.NextOffset:
		seekPast(from, -1) // (another consumer passed it already)
		return true, nil
	}
	at := max(from, e.Offset)
	bound := cmp.Or(g.cfg.MaxDecompressBatchBytes, 1<<30) // (franz-go's default)
	if first {
		g.log.Error("a record batch decompresses to more than the consumers may hold; dead-lettering its offsets and reading on after it",
			zap.String("group", g.cfg.Group), zap.String("topic", e.Topic), zap.Int32("partition", e.Partition),
			zap.Int64("offset", at), zap.Int64("next_offset", e.NextOffset), zap.Int("max_decompress_batch_bytes", bound))
	}
	rec := &kgo.Record{Topic: e.Topic, Partition: e.Partition, Offset: at, LeaderEpoch: e.Epoch}
	reason := fmt.Sprintf("%s: the record batch at offsets %d to %d decompresses to more than %d bytes, the most the consumers hold for one batch "+
		"(memory_limit sets it): its records were not read", correlator.CodeTooLarge, at, e.NextOffset-1, bound)
	adv := []store.OffsetAdvance{{Topic: e.Topic, Partition: e.Partition, From: from, To: e.NextOffset}}
	after, _, err := g.app.apply(ctx, nil, []refusal{{rec: rec, reason: reason}}, adv, false)
	switch {
	case err == nil:
		// (No record to mark for the Kafka commit: the seek sets franz-go's
		// committed position too, and the next records marked commit.)
		_ = g.settle(ctx, nil, adv, after, nil) // (nil when the write succeeded)
		seekPast(e.NextOffset, e.Epoch)
		return true, nil
	case errors.Is(err, store.ErrOffsetConflict):
		// Another consumer moved the stored offset: past the batch, read
		// on from there; else tried again from it.
		g.reload(ctx, adv)
		g.mu.Lock()
		from, known = g.pos[tp]
		g.mu.Unlock()
		if known && from >= e.NextOffset {
			seekPast(from, -1)
			return true, nil
		}
	}
	return false, err
}

// fresh drops records before the stored offset (already applied), and
// those of partitions paused on a hold (read before the pause; the
// partition is read again from its held record when it resumes).
func (g *group) fresh(recs []*kgo.Record) []*kgo.Record {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := recs[:0]
	for _, r := range recs {
		tp := store.TopicPartition{Topic: r.Topic, Partition: r.Partition}
		pos, ok := g.pos[tp]
		if h := g.holds[tp]; ok && r.Offset >= pos && (h == nil || !h.paused) {
			out = append(out, r)
		}
	}
	return out
}

// pending is recs less the records applied meanwhile (below the stored
// offset: a record written with the dead letter of the one before it) and
// those of partitions held in this pass.
func (g *group) pending(recs []*kgo.Record) []*kgo.Record {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []*kgo.Record
	for _, r := range recs {
		tp := store.TopicPartition{Topic: r.Topic, Partition: r.Partition}
		if h := g.holds[tp]; (h != nil && h.paused) || r.Offset < g.pos[tp] {
			continue
		}
		out = append(out, r)
	}
	return out
}

// advances computes each partition's move for recs, from the stored offset.
func (g *group) advances(recs []*kgo.Record) []store.OffsetAdvance {
	g.mu.Lock()
	defer g.mu.Unlock()
	idx := map[store.TopicPartition]int{}
	var adv []store.OffsetAdvance
	for _, r := range recs {
		tp := store.TopicPartition{Topic: r.Topic, Partition: r.Partition}
		i, ok := idx[tp]
		if !ok {
			i = len(adv)
			idx[tp] = i
			from, known := g.pos[tp]
			if !known {
				from = -1
			}
			adv = append(adv, store.OffsetAdvance{Topic: r.Topic, Partition: r.Partition, From: from})
		}
		adv[i].To = r.Offset + 1
	}
	return adv
}

// process applies recs. A batch PostgreSQL refuses for any reason that
// is not passing (store.IsTransient: the connection, a lost race, the
// server shutting down or out of a resource) is split until the record at
// fault is found. A record refused alone for its data is dead-lettered; a
// record refused alone otherwise is dead-lettered only once the record
// after it shows the refusal was its own (refused). So no error class,
// listed or not, can stall a partition for one record, and an error that
// is not the records' own (a privilege revoked, a column renamed) stalls
// the partitions instead of dead-lettering all their records.
func (g *group) process(ctx context.Context, recs []*kgo.Record) error {
	return g.applyRun(ctx, recs, recs)
}

// applyRun applies recs, a run of the pass all.
func (g *group) applyRun(ctx context.Context, all, recs []*kgo.Record) error {
	recs = g.pending(recs)
	if len(recs) == 0 {
		return nil
	}
	adv := g.advances(recs)
	after, _, err := g.app.apply(ctx, recs, nil, adv, false)
	if refusedBy(ctx, err) {
		if len(recs) > 1 {
			half := len(recs) / 2
			if err := g.applyRun(ctx, all, recs[:half]); err != nil {
				return err
			}
			return g.applyRun(ctx, all, recs[half:])
		}
		return g.refused(ctx, all, recs[0], err)
	}
	return g.settle(ctx, recs, adv, after, err)
}

// refusedBy reports whether err is PostgreSQL refusing a write for good
// (not a lost offset race, not a batch that had to write and did not,
// not passing, not a shutdown).
func refusedBy(ctx context.Context, err error) bool {
	return err != nil && !errors.Is(err, store.ErrOffsetConflict) && !errors.Is(err, store.ErrNoWrite) &&
		!store.IsTransient(err) && ctx.Err() == nil
}

// settle ends a write of recs with adv: on commit, it moves the stored
// offsets and lets go of the holds passed, and marks the records for the
// Kafka commit; on an offset conflict, it seeks to the stored offsets.
func (g *group) settle(ctx context.Context, recs []*kgo.Record, adv []store.OffsetAdvance, after func(), err error) error {
	if errors.Is(err, store.ErrOffsetConflict) {
		g.log.Warn("records were already applied by another consumer; seeking to the stored offsets",
			zap.String("group", g.cfg.Group), zap.Int("records", len(recs)))
		g.reload(ctx, adv)
		return nil
	}
	if err != nil {
		return err
	}
	g.hit("after-commit")
	g.mu.Lock()
	passed := false
	for _, a := range adv {
		tp := store.TopicPartition{Topic: a.Topic, Partition: a.Partition}
		g.pos[tp] = a.To
		if h := g.holds[tp]; h != nil && a.To > h.at {
			delete(g.holds, tp)
			passed = true
		}
	}
	g.mu.Unlock()
	if passed {
		g.reportStalls()
	}
	g.cl.MarkCommitRecords(recs...)
	if after != nil {
		after()
	}
	return nil
}

// refused decides for rec, refused alone with cause, within the pass all
// (see stall.go): a refusal of its data dead-letters it; any other is
// compared with the next record on its partition that writes more than a
// dead letter and is another input, written in one transaction with the
// records between them (those that write nothing) and, after them, rec
// and the copies of its input between them, tried again: dead-lettered
// if refused again (the refusal was theirs), else written (it had
// stopped between the tries).
func (g *group) refused(ctx context.Context, all []*kgo.Record, rec *kgo.Record, cause error) error {
	if store.IsDataError(cause) {
		return g.deadLetter(ctx, rec, cause)
	}
	own := g.app.input(rec)
	var next []*kgo.Record // the records after rec on its partition
	var inputs [][]string  // and their inputs
	for _, r := range all {
		if r.Topic == rec.Topic && r.Partition == rec.Partition && r.Offset > rec.Offset {
			next = append(next, r)
			inputs = append(inputs, g.app.input(r))
		}
	}
	for i := range next {
		if inputs[i] == nil || sameInput(own, inputs[i]) {
			continue
		}
		// next[i] is compared with rec only if it does write: a record
		// that writes nothing (a duplicate) rolls back and the next is
		// tried.
		refused := []refusal{{rec: rec, cause: cause}}
		var recs []*kgo.Record
		for j, a := range next[:i+1] {
			if sameInput(own, inputs[j]) {
				refused = append(refused, refusal{rec: a,
					cause: fmt.Errorf("the same input as offset %d, refused alone: %w", rec.Offset, cause)})
			} else {
				recs = append(recs, a)
			}
		}
		passed := append([]*kgo.Record{rec}, next[:i+1]...)
		adv := g.advances(passed)
		done, again, err := g.app.apply(ctx, recs, refused, adv, true)
		switch {
		case errors.Is(err, store.ErrNoWrite):
			continue
		case err == nil && again == nil:
			g.log.Info("record refused alone went through when tried again after the record after it: the refusal had stopped",
				zap.String("group", g.cfg.Group), zap.String("topic", rec.Topic), zap.Int32("partition", rec.Partition),
				zap.Int64("offset", rec.Offset), zap.String("sqlstate", reason(cause)))
			return g.settle(ctx, passed, adv, done, nil)
		case err == nil:
			for _, f := range refused {
				g.logDeadLetter(f.rec, again, "the record after it went through, and it was refused again after it")
			}
			return g.settle(ctx, passed, adv, done, nil)
		case !refusedBy(ctx, err):
			return g.settle(ctx, passed, adv, done, err)
		case store.SameRefusal(cause, err):
			g.hold(rec, err, true)
			return nil
		}
		// The record after it was refused otherwise: rec's refusal was its own.
		return g.deadLetter(ctx, rec, cause)
	}
	g.wait(rec, cause)
	return nil
}

// wait makes rec's partition wait on rec, refused alone with cause and
// with no record after it to compare with, until one comes or the
// refusal stops: it is never dead-lettered for waiting. Another partition
// of the group waiting on a refusal of the same class shows the refusal
// systemic; still alone after StallAfter, the wait is reported as a stall
// too (reportStalls).
func (g *group) wait(rec *kgo.Record, cause error) {
	tp := store.TopicPartition{Topic: rec.Topic, Partition: rec.Partition}
	g.mu.Lock()
	systemic := false
	for other, h := range g.holds {
		if other != tp && store.SameRefusal(h.err, cause) {
			h.systemic, systemic = true, true
		}
	}
	g.mu.Unlock()
	g.hold(rec, cause, systemic)
}

// hold makes rec's partition wait on it: paused and sought back to it,
// until a backoff passes.
func (g *group) hold(rec *kgo.Record, cause error, systemic bool) {
	tp := store.TopicPartition{Topic: rec.Topic, Partition: rec.Partition}
	now := time.Now()
	g.mu.Lock()
	h := g.holds[tp]
	if h == nil || h.at != rec.Offset {
		h = &hold{at: rec.Offset, since: now}
		g.holds[tp] = h
		if !systemic {
			g.log.Warn("record refused alone; its partition waits for a record after it to tell whether the refusal is the record's own",
				zap.String("group", g.cfg.Group), zap.String("topic", rec.Topic), zap.Int32("partition", rec.Partition),
				zap.Int64("offset", rec.Offset), zap.String("sqlstate", reason(cause)), zap.String("error", correlator.Clip(cause.Error(), 1024)))
		}
	}
	h.refused(cause, systemic, now)
	h.paused = true
	g.mu.Unlock()
	g.cl.PauseFetchPartitions(map[string][]int32{rec.Topic: {rec.Partition}})
	g.cl.SetOffsets(map[string]map[int32]kgo.EpochOffset{rec.Topic: {rec.Partition: {Epoch: -1, Offset: rec.Offset}}})
	g.reportStalls()
}

// nextDue is when the first paused partition is due again; false: none
// is paused.
func (g *group) nextDue() (next time.Time, ok bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, h := range g.holds {
		if h.paused && (!ok || h.until.Before(next)) {
			next, ok = h.until, true
		}
	}
	for _, s := range g.skips {
		if !ok || s.at.Before(next) {
			next, ok = s.at, true
		}
	}
	return next, ok
}

// resumeDue resumes the paused partitions whose hold's backoff passed,
// from their held records.
func (g *group) resumeDue() {
	now := time.Now()
	resume := map[string][]int32{}
	seek := map[string]map[int32]kgo.EpochOffset{}
	g.mu.Lock()
	for tp, h := range g.holds {
		if h.paused && !h.until.After(now) {
			h.paused = false
			resume[tp.Topic] = append(resume[tp.Topic], tp.Partition)
			if seek[tp.Topic] == nil {
				seek[tp.Topic] = map[int32]kgo.EpochOffset{}
			}
			seek[tp.Topic][tp.Partition] = kgo.EpochOffset{Epoch: -1, Offset: h.at}
		}
	}
	g.mu.Unlock()
	if len(resume) > 0 {
		g.cl.SetOffsets(seek)
		g.cl.ResumeFetchPartitions(resume)
	}
}

// reportStalls sets hipq_consumer_stalled and readiness from the holds
// shown to be systemic, or waiting alone for longer than StallAfter.
func (g *group) reportStalls() {
	var now []stalled
	g.mu.Lock()
	for tp, h := range g.holds {
		if h.stalls(g.cfg.StallAfter) {
			now = append(now, stalled{where: fmt.Sprintf("%s/%d at offset %d", tp.Topic, tp.Partition, h.at), err: h.err})
		}
	}
	for tp, s := range g.skips {
		if s.tries > 0 && time.Since(s.since) >= g.cfg.StallAfter {
			now = append(now, stalled{where: fmt.Sprintf("%s/%d at offset %d (a batch too large to read, its dead letter not written)",
				tp.Topic, tp.Partition, s.e.Offset), err: s.err})
		}
	}
	g.mu.Unlock()
	g.stalls.set(now)
}

// deadLetter dead-letters rec, refused alone for a fault of its own.
// Should the dead letter itself be refused (it keeps the record's bytes
// and headers), it is kept without its headers: the record's coordinates,
// key and value (bytes PostgreSQL always takes) and why. Should that be
// refused too, for a reason that is not its data (the dead-letter table
// broken), the partition is held on rec as on a systemic refusal: it
// waits, tries again with backoff and is reported as stalled.
func (g *group) deadLetter(ctx context.Context, rec *kgo.Record, cause error) error {
	// Held on its dead letter, a record is tried again quietly: the stall
	// is logged once a minute.
	held := g.heldOn(rec)
	if !held {
		g.logDeadLetter(rec, cause, "")
	}
	adv := g.advances([]*kgo.Record{rec})
	after, _, err := g.app.apply(ctx, nil, []refusal{{rec: rec, cause: cause}}, adv, false)
	if refusedBy(ctx, err) {
		if !held {
			g.log.Error("dead letter refused too; keeping it without its headers", zap.String("topic", rec.Topic),
				zap.Int32("partition", rec.Partition), zap.Int64("offset", rec.Offset), zap.String("error", correlator.Clip(err.Error(), 1024)))
		}
		after, _, err = g.app.apply(ctx, nil, []refusal{{rec: rec, bare: true,
			cause: fmt.Errorf("%w; its dead letter was refused with its headers: %v", cause, err)}}, adv, false)
		if refusedBy(ctx, err) && !store.IsDataError(err) {
			g.hold(rec, err, true)
			g.mu.Lock()
			if h := g.holds[store.TopicPartition{Topic: rec.Topic, Partition: rec.Partition}]; h != nil && h.at == rec.Offset {
				h.onDeadLetter = true
			}
			g.mu.Unlock()
			return nil
		}
	}
	return g.settle(ctx, []*kgo.Record{rec}, adv, after, err)
}

// heldOn reports whether rec's partition waits on rec's dead letter.
func (g *group) heldOn(rec *kgo.Record) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	h := g.holds[store.TopicPartition{Topic: rec.Topic, Partition: rec.Partition}]
	return h != nil && h.at == rec.Offset && h.onDeadLetter
}

func (g *group) logDeadLetter(rec *kgo.Record, cause error, why string) {
	fields := append(tracing.LogFieldsOf(correlator.TraceContextOf(source(rec).Headers)),
		zap.String("group", g.cfg.Group), zap.String("topic", rec.Topic), zap.Int32("partition", rec.Partition),
		zap.Int64("offset", rec.Offset), zap.String("sqlstate", reason(cause)), zap.String("error", correlator.Clip(cause.Error(), 1024)))
	if why != "" {
		fields = append(fields, zap.String("because", why))
	}
	g.log.Warn("record refused by PostgreSQL; dead-lettering it", fields...)
}

// Stalled is nil while no partition of the group waits on a refusal shown
// to be systemic (or alone for longer than StallAfter), else what waits
// and why.
func (g *group) Stalled() error { return g.stalls.err() }

// reload reads the stored offsets of adv's partitions and seeks there.
// A hold on a record below the stored offset is over (another consumer
// applied the record): it is let go of, its partition resumed.
func (g *group) reload(ctx context.Context, adv []store.OffsetAdvance) {
	tps := make([]store.TopicPartition, len(adv))
	for i, a := range adv {
		tps[i] = store.TopicPartition{Topic: a.Topic, Partition: a.Partition}
	}
	stored, err := g.st.OffsetsLoad(ctx, g.cfg.Group, tps)
	if err != nil {
		g.log.Warn("cannot reload stored offsets", zap.Error(err))
		return
	}
	seek := map[string]map[int32]kgo.EpochOffset{}
	resume := map[string][]int32{}
	passed := false
	g.mu.Lock()
	for _, tp := range tps {
		if next, ok := stored[tp]; ok {
			g.pos[tp] = next
			if seek[tp.Topic] == nil {
				seek[tp.Topic] = map[int32]kgo.EpochOffset{}
			}
			seek[tp.Topic][tp.Partition] = kgo.EpochOffset{Epoch: -1, Offset: next}
			if h := g.holds[tp]; h != nil && h.at < next {
				delete(g.holds, tp)
				passed = true
				if h.paused {
					resume[tp.Topic] = append(resume[tp.Topic], tp.Partition)
				}
			}
		}
	}
	g.mu.Unlock()
	g.cl.SetOffsets(seek)
	if len(resume) > 0 {
		g.cl.ResumeFetchPartitions(resume)
	}
	if passed {
		g.reportStalls()
	}
}

// reseek rewinds the partitions of recs to their first record, so a batch
// that could not be written is read again.
func (g *group) reseek(recs []*kgo.Record) {
	seek := map[string]map[int32]kgo.EpochOffset{}
	for _, r := range recs {
		if seek[r.Topic] == nil {
			seek[r.Topic] = map[int32]kgo.EpochOffset{}
		}
		if _, ok := seek[r.Topic][r.Partition]; !ok {
			seek[r.Topic][r.Partition] = kgo.EpochOffset{Epoch: -1, Offset: r.Offset}
		}
	}
	g.cl.SetOffsets(seek)
}

// hit kills the process at a named crash point; tests use it to prove a
// crash between the PostgreSQL commit and the Kafka commit loses nothing
// and applies nothing twice.
func (g *group) hit(point string) {
	if c := g.cfg.CrashPoint; c != "" && c == g.cfg.Group+":"+point {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
}

func backoff(try int) time.Duration {
	d := 100 * time.Millisecond << min(try, 8)
	return min(d, 10*time.Second)
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// copyDeadLetters copies a batch's dead letters to topic (none: logged
// only), after their transaction committed, and records each that came
// in a trace as a span "dead letter" there.
func (g *group) copyDeadLetters(topic string, dls []store.DeadLetter) {
	(&deadletter.Copier{Client: g.cl, Topic: topic, Log: g.log}).Copy(dls)
	traceDeadLetters(context.Background(), g.cfg.Tracer, dls)
}

// traceDeadLetters records a span "dead letter" in the trace of each
// dead letter whose input came with one (tracing on).
func traceDeadLetters(ctx context.Context, tr trace.Tracer, dls []store.DeadLetter) {
	if tr == nil {
		return
	}
	for _, d := range dls {
		own := correlator.TraceContextOf(d.Source.Headers)
		if own.IsZero() {
			continue
		}
		attrs := []attribute.KeyValue{attribute.String("hipq.dead_letter.source", d.Kind),
			attribute.String("hipq.dead_letter.reason", correlator.Clip(d.Reason, 512))}
		if d.Source.Topic != "" {
			attrs = append(attrs, attribute.String("messaging.destination.name", d.Source.Topic),
				attribute.Int64("messaging.kafka.offset", d.Source.Offset))
		}
		tracing.RecordEnded(ctx, tr, tracing.Ended{Name: "dead letter", Kind: trace.SpanKindConsumer, Own: own, Attrs: attrs})
	}
}

// rejected is the reason of a record PostgreSQL refused on its own.
func rejected(cause error) string {
	return correlator.CodeRejected + ": PostgreSQL refused it: " + correlator.Clip(cause.Error(), 1024)
}

func source(r *kgo.Record) store.Source {
	hs := make([]correlator.Header, len(r.Headers))
	for i, h := range r.Headers {
		hs[i] = correlator.Header{Key: h.Key, Value: h.Value}
	}
	return store.Source{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value,
		Headers: hs} // received_at: the database's now()
}

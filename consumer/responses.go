package consumer

import (
	"cmp"
	"context"
	"slices"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
)

// ResponsesConfig configures the response consumer.
type ResponsesConfig struct {
	GroupConfig
	DeadLetterTopic string
	EarlyTTL        time.Duration
	Matchers        map[string]correlator.Matcher // by topic
	Types           correlator.Types
}

// Responses matches replies read from the response topics to their jobs.
type Responses struct {
	g   *group
	cfg ResponsesConfig
}

// NewResponses builds the response consumer; Run starts it.
func NewResponses(log *zap.Logger, st *store.Store, cfg ResponsesConfig) (*Responses, error) {
	cfg.GroupConfig = cfg.GroupConfig.WithDefaults()
	cfg.EarlyTTL = cmp.Or(cfg.EarlyTTL, DefaultEarlyTTL)
	rs := &Responses{cfg: cfg}
	g, err := newGroup(log.Named("responses"), st, cfg.GroupConfig, rs)
	if err != nil {
		return nil, err
	}
	rs.g = g
	return rs, nil
}

// Run polls and applies replies until ctx ends, then leaves the group.
func (rs *Responses) Run(ctx context.Context) error { return rs.g.Run(ctx) }

// Stalled is nil while no partition waits on a refusal that is not the
// records' own, else what waits and why (readiness).
func (rs *Responses) Stalled() error { return rs.g.Stalled() }

// input names the attempt rec replies to: by its job id, and by its job's
// type and key, each with the attempt it names (or none).
func (rs *Responses) input(rec *kgo.Record) []string {
	r, err := rs.match(rec, source(rec))
	if err != nil {
		return nil
	}
	attempt := "-"
	if r.Attempt != nil {
		attempt = strconv.Itoa(*r.Attempt)
	}
	names := []string{} // (decoded: not nil)
	if r.JobID != nil {
		names = append(names, "id\x00"+strconv.FormatInt(*r.JobID, 10)+"\x00"+attempt)
	}
	if r.JobKey != "" {
		names = append(names, "key\x00"+r.JobType+"\x00"+r.JobKey+"\x00"+attempt)
	}
	return names
}

// match reads a reply from r.
func (rs *Responses) match(r *kgo.Record, src store.Source) (*correlator.Reply, error) {
	m, ok := rs.cfg.Matchers[r.Topic]
	if !ok {
		m = correlator.DefaultMatcher()
	}
	if err := correlator.CheckHeaders(src.Headers); err != nil {
		return nil, err
	}
	return m.Match(&correlator.Record{Key: r.Key, Value: r.Value, Headers: src.Headers})
}

func (rs *Responses) apply(ctx context.Context, recs []*kgo.Record, refused []refusal, adv []store.OffsetAdvance, compare bool) (func(), error, error) {
	start := time.Now()
	b := store.ReplyBatch{Group: rs.cfg.Group, Offsets: adv, EarlyTTL: rs.cfg.EarlyTTL, MustWrite: compare}
	b.Replies, b.DeadLetters = rs.decode(recs)
	if dls := deadLetters(refused, store.SourceReply); compare && len(refused) > 0 {
		b.Retry = &store.ReplyRetry{Refused: dls}
		b.Retry.Replies, b.Retry.DeadLetters = rs.decode(recsOf(refused))
	} else {
		b.DeadLetters = append(b.DeadLetters, dls...)
	}
	res, err := rs.g.st.ReplyApply(ctx, b, rs.cfg.Types)
	if err != nil {
		return nil, nil, err
	}
	unreadable, ins := len(b.DeadLetters), b.Replies
	if b.Retry != nil && res.RefusedAgain == nil {
		unreadable += len(b.Retry.DeadLetters)
		ins = append(slices.Clip(ins), b.Retry.Replies...)
	}
	return func() {
		rs.countUnreadable(unreadable)
		rs.cfg.Metrics.ObserveReplies(metrics.SourceKafka, res.Counts(), res.RoundTrips())
		rs.g.log.Debug("reply batch applied", zap.Int("records", len(recs)), zap.Int("applied", len(res.Applied)),
			zap.Int("dead_lettered", len(res.DeadLetters)))
		rs.g.copyDeadLetters(rs.cfg.DeadLetterTopic, res.DeadLetters)
		rs.trace(ctx, start, ins, res)
	}, res.RefusedAgain, nil
}

// decode matches response records to replies; a record that matches
// nothing is a dead letter.
func (rs *Responses) decode(recs []*kgo.Record) ([]store.ReplyIn, []store.DeadLetter) {
	ins := make([]store.ReplyIn, 0, len(recs))
	var dls []store.DeadLetter
	for _, r := range recs {
		src := source(r)
		reply, err := rs.match(r, src)
		if err != nil {
			dls = append(dls, store.DeadLetter{Kind: store.SourceReply, Source: src, Reason: err.Error()})
			continue
		}
		ins = append(ins, store.ReplyIn{Reply: reply, Kind: store.SourceReply, Source: src})
	}
	return ins, dls
}

// countUnreadable counts replies dead-lettered before matching.
func (rs *Responses) countUnreadable(n int) {
	if n > 0 {
		rs.cfg.Metrics.Replies.WithLabelValues(metrics.SourceKafka, "dead_lettered").Add(float64(n))
	}
}

// trace records a span for each applied reply (tracing on): "process
// <topic>", a child of the send span of the attempt it ended (kept on the
// attempt, however long ago it was sent), linked to the reply's own
// context, saying how the attempt ended.
func (rs *Responses) trace(ctx context.Context, start time.Time, ins []store.ReplyIn, res store.ReplyResult) {
	tr := rs.cfg.Tracer
	if tr == nil || len(res.Applied) == 0 {
		return
	}
	refs := make([]store.AttemptRef, len(res.Applied))
	for i, a := range res.Applied {
		refs[i] = a.AttemptRef
	}
	sends, err := rs.g.st.AttemptTraces(ctx, refs)
	if err != nil {
		rs.g.log.Debug("cannot read the attempts' send spans; reply spans start traces of their own", zap.Error(err))
	}
	for _, a := range res.Applied {
		src := ins[a.Index].Source
		res := a.Res
		tracing.RecordEnded(ctx, tr, tracing.Ended{Name: "process " + src.Topic, Kind: trace.SpanKindConsumer, Start: start,
			Send: correlator.TraceContext{Parent: sends[a.AttemptRef]}, Own: correlator.TraceContextOf(src.Headers), Result: &res,
			Attrs: append(tracing.AttemptAttrs(a.JobID, a.Attempt),
				attribute.String("messaging.system", "kafka"),
				attribute.String("messaging.destination.name", src.Topic),
				attribute.String("messaging.operation.type", "process"),
				attribute.String("messaging.destination.partition.id", strconv.Itoa(int(src.Partition))),
				attribute.Int64("messaging.kafka.offset", src.Offset),
				attribute.String("messaging.consumer.group.name", rs.cfg.Group))})
	}
}

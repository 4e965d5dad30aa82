package dispatcher

import (
	"context"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
)

// startSends starts one send span per job (tracing on): a child of the
// job's intake context, kept with the job however long ago it came (or
// linked to it), named "send <destination>". Its context goes into the
// job's Trace headers, which the transport writes on the request, and is
// kept on the attempt before the send, so the reply's span, however soon
// it comes, finds its parent. The returned end closes the spans with what
// became of each send. With tracing off it returns nil and does nothing.
func (d *Dispatcher) startSends(ctx context.Context, s Sender, jobs []store.Claimed) (end func([]Result)) {
	tr := d.cfg.Tracer
	if tr == nil || len(jobs) == 0 {
		return nil
	}
	refs := make([]store.AttemptRef, len(jobs))
	for i := range jobs {
		refs[i] = jobs[i].Ref()
	}
	parents, err := d.st.JobTraces(ctx, refs)
	if err != nil {
		// Spans are a hint: the sends go on, in traces of their own.
		d.log.Debug("cannot read the jobs' trace contexts; their sends start traces of their own", zap.Error(err))
	}
	system := transportName(s)
	spans := make([]trace.Span, len(jobs))
	kept := make([]store.AttemptTrace, 0, len(jobs))
	for i := range jobs {
		c := &jobs[i]
		r := d.route(s, c.JobType)
		opts := []trace.SpanStartOption{trace.WithAttributes(
			attribute.String("messaging.system", system),
			attribute.String("messaging.destination.name", r.Destination),
			attribute.String("messaging.operation.type", "send"),
			attribute.Int64("hipq.job.id", c.ID),
			attribute.String("hipq.job.type", c.JobType),
			attribute.String("hipq.job.key", c.JobKey),
			attribute.Int("hipq.attempt", c.Attempt),
		)}
		if system == "http" {
			opts = append(opts, trace.WithSpanKind(trace.SpanKindClient))
		} else {
			opts = append(opts, trace.WithSpanKind(trace.SpanKindProducer))
		}
		pctx := ctx
		if sc := tracing.Remote(parents[c.ID]); sc.IsValid() {
			if d.cfg.TraceLink {
				opts = append(opts, trace.WithNewRoot(), trace.WithLinks(trace.Link{SpanContext: sc}))
			} else {
				pctx = trace.ContextWithRemoteSpanContext(ctx, sc)
			}
		}
		sctx, span := tr.Start(pctx, "send "+r.Destination, opts...)
		spans[i] = span
		carrier := propagation.MapCarrier{}
		tracing.Propagator.Inject(sctx, carrier)
		c.Trace = carrier
		kept = append(kept, store.AttemptTrace{AttemptRef: c.Ref(), Parent: carrier[correlator.HeaderTraceParent]})
	}
	if err := d.st.AttemptTracesWrite(ctx, kept); err != nil {
		d.log.Debug("cannot keep the send spans on their attempts; replies will start traces of their own", zap.Error(err))
	}
	return func(results []Result) {
		for i, span := range spans {
			res := results[i]
			span.SetAttributes(attribute.String("hipq.send.status", statusLabels[res.Status]))
			if res.Status != Sent {
				msg := statusLabels[res.Status]
				if res.Err != nil {
					msg = res.Err.Error()
				}
				span.SetStatus(codes.Error, msg)
			}
			if res.Status == NotSent || res.Status == Refused || res.Status == Unknown {
				span.AddEvent("claim undone or ended: " + statusLabels[res.Status] + " (attempt " + strconv.Itoa(jobs[i].Attempt) + ")")
			}
			span.End()
		}
	}
}

// traceSyncReplies records a span for each reply that came with its send
// (HTTP sync mode) and ended its attempt: a child of the send span.
func (d *Dispatcher) traceSyncReplies(ctx context.Context, jobs []store.Claimed, res store.ReplyResult) {
	if d.cfg.Tracer == nil {
		return
	}
	sends := map[int64]string{}
	for _, c := range jobs {
		sends[c.ID] = c.Trace[correlator.HeaderTraceParent]
	}
	for _, a := range res.Applied {
		end := a.Res
		tracing.RecordEnded(ctx, d.cfg.Tracer, tracing.Ended{Name: "process sync reply", Kind: trace.SpanKindInternal,
			Send: correlator.TraceContext{Parent: sends[a.JobID]}, Result: &end, Attrs: tracing.AttemptAttrs(a.JobID, a.Attempt)})
	}
}

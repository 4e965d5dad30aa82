// Package tracing sets up OpenTelemetry tracing for hipq: an SDK tracer
// provider exporting over OTLP/HTTP, W3C trace context propagation, and
// the helpers the roles use to turn a stored trace context into a parent.
//
// Off by default: without an endpoint (in the config or the standard
// OTEL_EXPORTER_OTLP_* variables) Start returns a Tracing whose Tracer is
// nil, and every role skips its tracing work.
package tracing

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
)

// Samplers, by OpenTelemetry's names (the values of OTEL_TRACES_SAMPLER).
const (
	SamplerAlwaysOn                = "always_on"  // every trace, whatever a parent decided
	SamplerAlwaysOff               = "always_off" // no trace, whatever a parent decided
	SamplerTraceIDRatio            = "traceidratio"
	SamplerParentBasedAlwaysOn     = "parentbased_always_on"
	SamplerParentBasedAlwaysOff    = "parentbased_always_off"
	SamplerParentBasedTraceIDRatio = "parentbased_traceidratio"
	// DefaultSampler follows a parent's decision, and samples Ratio of
	// the traces hipq starts.
	DefaultSampler = SamplerParentBasedTraceIDRatio
)

// Samplers are the sampler names accepted, OpenTelemetry's.
var Samplers = []string{SamplerAlwaysOn, SamplerAlwaysOff, SamplerTraceIDRatio,
	SamplerParentBasedAlwaysOn, SamplerParentBasedAlwaysOff, SamplerParentBasedTraceIDRatio}

// SamplerParentRatio is hipq's former name of parentbased_traceidratio,
// still accepted in the config file (with a warning) for one release.
const SamplerParentRatio = "parent_ratio"

// DefaultRatio samples every new trace.
const DefaultRatio = 1.0

// TakesRatio reports whether a sampler reads the ratio.
func TakesRatio(sampler string) bool {
	return sampler == SamplerTraceIDRatio || sampler == SamplerParentBasedTraceIDRatio || sampler == SamplerParentRatio
}

// SamplerNote is the warning a config's sampler name deserves, or "": a
// former hipq name, or an OpenTelemetry name whose meaning in hipq changed.
func SamplerNote(sampler string) string {
	switch sampler {
	case SamplerParentRatio:
		return "tracing.sampler parent_ratio is deprecated and will be refused by the next release: " +
			"write parentbased_traceidratio (the same sampler, OpenTelemetry's name)"
	case SamplerAlwaysOn:
		return "tracing.sampler always_on now has OpenTelemetry's meaning: every trace is sampled, even below a parent " +
			"that was not; write parentbased_always_on to follow a parent's decision as hipq's always_on did before"
	case SamplerAlwaysOff:
		return "tracing.sampler always_off now has OpenTelemetry's meaning: no trace is sampled, even below a parent " +
			"that was; write parentbased_always_off to follow a parent's decision as hipq's always_off did before"
	}
	return ""
}

// Config is the tracing section of the config.
type Config struct {
	// Endpoint is the OTLP/HTTP collector's base URL (http://host:4318);
	// empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
	// OTEL_EXPORTER_OTLP_ENDPOINT, and without either tracing is off.
	Endpoint string
	// Sampler is one of Samplers (or SamplerParentRatio). Empty:
	// OTEL_TRACES_SAMPLER, else DefaultSampler.
	Sampler string
	// Ratio is the share of traces the ratio samplers start, 0 to 1. 0:
	// OTEL_TRACES_SAMPLER_ARG, else DefaultRatio.
	Ratio float64
	// ServiceName defaults to OTEL_SERVICE_NAME, else Name.
	ServiceName string
	Name        string // the deployment's name
	// Link makes a send span link to the job's intake context instead of
	// being its child (for backends that show days-long traces badly).
	Link bool
	// BatchTimeout is how long finished spans wait to be exported in a
	// batch; 0: the SDK's default.
	BatchTimeout time.Duration
}

// Tracing is the process's tracing, on or off.
type Tracing struct {
	// Tracer and Provider are nil when tracing is off.
	Tracer   trace.Tracer
	Provider trace.TracerProvider
	Link     bool
	// Sampler describes the sampler in use (the SDK's description).
	Sampler  string
	provider *sdktrace.TracerProvider
}

// Start sets tracing up from cfg and the OTEL_* environment.
func Start(ctx context.Context, cfg Config) (*Tracing, error) {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return &Tracing{}, nil
	}
	var opts []otlptracehttp.Option
	switch {
	case cfg.Endpoint != "":
		u, err := url.Parse(cfg.Endpoint)
		if err != nil || u.Scheme == "" || u.Host == "" {
			return nil, fmt.Errorf("tracing.endpoint: %q is not an absolute URL", cfg.Endpoint)
		}
		if u.Path == "" || u.Path == "/" {
			u.Path = "/v1/traces"
		}
		opts = append(opts, otlptracehttp.WithEndpointURL(u.String()))
	case os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "":
		return &Tracing{}, nil
	}
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("tracing: %w", err)
	}
	name := cfg.ServiceName
	if name == "" {
		name = os.Getenv("OTEL_SERVICE_NAME")
	}
	if name == "" {
		name = cfg.Name
	}
	res, err := resource.New(ctx, resource.WithFromEnv(), resource.WithAttributes(attribute.String("service.name", name)))
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("tracing: resource: %w", err)
	}
	var bOpts []sdktrace.BatchSpanProcessorOption
	if cfg.BatchTimeout > 0 {
		bOpts = append(bOpts, sdktrace.WithBatchTimeout(cfg.BatchTimeout))
	}
	sampler, err := newSampler(cfg, os.Getenv)
	if err != nil {
		return nil, err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp, bOpts...), sdktrace.WithResource(res), sdktrace.WithSampler(sampler))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(Propagator)
	return &Tracing{Tracer: tp.Tracer("github.com/hipq/hipq"), Provider: tp, Link: cfg.Link, Sampler: sampler.Description(), provider: tp}, nil
}

// newSampler is the sampler the config names, else OTEL_TRACES_SAMPLER,
// else DefaultSampler; its ratio is the config's, else
// OTEL_TRACES_SAMPLER_ARG, else DefaultRatio. Each key is taken from the
// environment only when the config leaves it out.
func newSampler(cfg Config, getenv func(string) string) (sdktrace.Sampler, error) {
	name, ratio := cfg.Sampler, cfg.Ratio
	if name == "" {
		name = strings.TrimSpace(getenv("OTEL_TRACES_SAMPLER"))
		if name != "" && !slices.Contains(Samplers, name) {
			return nil, fmt.Errorf("OTEL_TRACES_SAMPLER: %q is not one of %s (hipq does not support the others)", name, strings.Join(Samplers, ", "))
		}
		name = cmp.Or(name, DefaultSampler)
	}
	if ratio == 0 {
		ratio = DefaultRatio
		if arg := strings.TrimSpace(getenv("OTEL_TRACES_SAMPLER_ARG")); arg != "" && TakesRatio(name) {
			v, err := strconv.ParseFloat(arg, 64)
			if err != nil || v < 0 || v > 1 {
				return nil, fmt.Errorf("OTEL_TRACES_SAMPLER_ARG: %q is not a ratio between 0 and 1", arg)
			}
			ratio = v
		}
	}
	if ratio < 0 || ratio > 1 {
		return nil, fmt.Errorf("tracing.ratio: %v is not between 0 and 1", ratio)
	}
	switch name {
	case SamplerAlwaysOn:
		return sdktrace.AlwaysSample(), nil
	case SamplerAlwaysOff:
		return sdktrace.NeverSample(), nil
	case SamplerTraceIDRatio:
		return sdktrace.TraceIDRatioBased(ratio), nil
	case SamplerParentBasedAlwaysOn:
		return sdktrace.ParentBased(sdktrace.AlwaysSample()), nil
	case SamplerParentBasedAlwaysOff:
		return sdktrace.ParentBased(sdktrace.NeverSample()), nil
	case SamplerParentBasedTraceIDRatio, SamplerParentRatio:
		return sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio)), nil
	}
	return nil, fmt.Errorf("tracing.sampler: %q is not one of %s", name, strings.Join(Samplers, ", "))
}

// Shutdown flushes the spans not yet exported.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if t == nil || t.provider == nil {
		return nil
	}
	return t.provider.Shutdown(ctx)
}

// Propagator reads and writes W3C traceparent and tracestate.
var Propagator = propagation.TraceContext{}

// Remote is the span context a stored trace context names; invalid when
// there is none.
func Remote(tc correlator.TraceContext) trace.SpanContext {
	if tc.IsZero() {
		return trace.SpanContext{}
	}
	c := propagation.MapCarrier{correlator.HeaderTraceParent: tc.Parent}
	if tc.State != "" {
		c[correlator.HeaderTraceState] = tc.State
	}
	return trace.SpanContextFromContext(Propagator.Extract(context.Background(), c))
}

// Of is the trace context of the span in ctx, as hipq stores it.
func Of(ctx context.Context) correlator.TraceContext {
	c := propagation.MapCarrier{}
	Propagator.Inject(ctx, c)
	return correlator.TraceContext{Parent: c[correlator.HeaderTraceParent], State: c[correlator.HeaderTraceState]}
}

// Ended describes a span that records something already done to one
// attempt (a reply processed, a timeout): a child of the attempt's send
// span when it has one, else of the input's own context, linked to the
// input's own context when both exist.
type Ended struct {
	Name   string
	Kind   trace.SpanKind
	Start  time.Time // zero: now
	Send   correlator.TraceContext
	Own    correlator.TraceContext
	Attrs  []attribute.KeyValue
	Result *correlator.Resolution // how the attempt ended, when it did
}

// RecordEnded records e with tr (a nil tr does nothing).
func RecordEnded(ctx context.Context, tr trace.Tracer, e Ended) {
	if tr == nil {
		return
	}
	opts := []trace.SpanStartOption{trace.WithSpanKind(e.Kind), trace.WithAttributes(e.Attrs...)}
	if !e.Start.IsZero() {
		opts = append(opts, trace.WithTimestamp(e.Start))
	}
	send, own := Remote(e.Send), Remote(e.Own)
	switch {
	case send.IsValid():
		ctx = trace.ContextWithRemoteSpanContext(ctx, send)
		if own.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: own}))
		}
	case own.IsValid():
		ctx = trace.ContextWithRemoteSpanContext(ctx, own)
	}
	_, span := tr.Start(ctx, e.Name, opts...)
	if r := e.Result; r != nil {
		outcome := string(r.State)
		if r.State == correlator.StateFinal {
			outcome = string(r.Outcome)
		}
		span.SetAttributes(attribute.String("hipq.outcome", outcome))
		if r.State == correlator.StateRetry {
			span.AddEvent("retry scheduled", trace.WithAttributes(attribute.String("hipq.next_run", r.NextRun.Format(time.RFC3339Nano))))
		}
		if r.State == correlator.StateFinal && r.Outcome != correlator.OutcomeSucceeded {
			span.SetStatus(codes.Error, r.Error)
		}
	}
	span.End()
}

// AttemptAttrs are the attributes naming one attempt.
func AttemptAttrs(jobID int64, attempt int) []attribute.KeyValue {
	return []attribute.KeyValue{attribute.Int64("hipq.job.id", jobID), attribute.Int("hipq.attempt", attempt)}
}

// LogFields are the log fields naming the trace of the span in ctx: a
// trace_id (and span_id), or none.
func LogFields(ctx context.Context) []zap.Field {
	return spanFields(trace.SpanContextFromContext(ctx))
}

// LogFieldsOf are LogFields for a stored or received trace context.
func LogFieldsOf(tc correlator.TraceContext) []zap.Field { return spanFields(Remote(tc)) }

func spanFields(sc trace.SpanContext) []zap.Field {
	if !sc.IsValid() {
		return nil
	}
	return []zap.Field{zap.String("trace_id", sc.TraceID().String()), zap.String("span_id", sc.SpanID().String())}
}

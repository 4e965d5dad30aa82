package tracing

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/trace"

	"github.com/hipq/hipq/correlator"
)

func TestLogFields(t *testing.T) {
	fs := LogFieldsOf(correlator.TraceContext{Parent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
	if len(fs) != 2 || fs[0].Key != "trace_id" || fs[0].String != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Fatalf("fields %v", fs)
	}
	if fs := LogFieldsOf(correlator.TraceContext{}); fs != nil {
		t.Fatalf("no trace, fields %v", fs)
	}
	if fs := LogFields(context.Background()); fs != nil {
		t.Fatalf("no span, fields %v", fs)
	}
}

// Off unless an endpoint is given: no tracer, nothing to shut down.
func TestOffByDefault(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	tr, err := Start(context.Background(), Config{Name: "hipq"})
	if err != nil || tr.Tracer != nil || tr.Provider != nil {
		t.Fatalf("%+v %v", tr, err)
	}
	if err := tr.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Setenv("OTEL_SDK_DISABLED", "true")
	if tr, err := Start(context.Background(), Config{Endpoint: "http://127.0.0.1:4318"}); err != nil || tr.Tracer != nil {
		t.Fatalf("OTEL_SDK_DISABLED: %+v %v", tr, err)
	}
	t.Setenv("OTEL_SDK_DISABLED", "")
	if _, err := Start(context.Background(), Config{Endpoint: "http://127.0.0.1:4318", Sampler: "sometimes"}); err == nil {
		t.Fatal("a bad sampler was taken")
	}
}

// tracing.sampler takes OpenTelemetry's sampler names, always_on and
// always_off with their OpenTelemetry meaning (the parent's decision
// ignored); parent_ratio stays, for now, as parentbased_traceidratio.
// OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG apply to what the
// config leaves out.
func TestSamplers(t *testing.T) {
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer collector.Close()
	t.Setenv("OTEL_SDK_DISABLED", "")
	parent := func(sampled bool) context.Context {
		sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, Remote: true})
		if sampled {
			sc = sc.WithTraceFlags(trace.FlagsSampled)
		}
		return trace.ContextWithRemoteSpanContext(context.Background(), sc)
	}
	// sampled: a new trace, below a parent not sampled, below a sampled one.
	type sampled struct{ root, underUnsampled, underSampled bool }
	for _, c := range []struct {
		sampler          string
		ratio            float64
		env, arg         string
		want             sampled
		wantDescribed    string // a part of the sampler's description
		wantErrSubstring string
	}{
		{sampler: "always_on", want: sampled{true, true, true}},
		{sampler: "always_off", want: sampled{false, false, false}},
		{sampler: "traceidratio", want: sampled{true, true, true}},
		{sampler: "traceidratio", ratio: 0.25, wantDescribed: "TraceIDRatioBased{0.25}"},
		{sampler: "parentbased_always_on", want: sampled{true, false, true}},
		{sampler: "parentbased_always_off", want: sampled{false, false, true}},
		{sampler: "parentbased_traceidratio", want: sampled{true, false, true}},
		{sampler: "parentbased_traceidratio", ratio: 0.25, wantDescribed: "ParentBased{root:TraceIDRatioBased{0.25}"},
		{want: sampled{true, false, true}, wantDescribed: "ParentBased{root:TraceIDRatioBased{1}"}, // the default
		{sampler: "parent_ratio", ratio: 0.25, wantDescribed: "ParentBased{root:TraceIDRatioBased{0.25}"},
		{sampler: "parent_ratio", want: sampled{true, false, true}},
		{env: "always_off", want: sampled{false, false, false}},
		{env: "always_on", want: sampled{true, true, true}},
		{env: "traceidratio", arg: "0.5", wantDescribed: "TraceIDRatioBased{0.5}"},
		{env: "parentbased_traceidratio", arg: "0", want: sampled{false, false, true}},
		{sampler: "parentbased_always_on", env: "always_off", want: sampled{true, false, true}},
		{sampler: "traceidratio", ratio: 0.25, arg: "0.5", wantDescribed: "TraceIDRatioBased{0.25}"},
		{env: "jaeger_remote", wantErrSubstring: "OTEL_TRACES_SAMPLER: \"jaeger_remote\""},
		{env: "traceidratio", arg: "2", wantErrSubstring: "OTEL_TRACES_SAMPLER_ARG: \"2\""},
		{sampler: "sometimes", wantErrSubstring: "tracing.sampler: \"sometimes\""},
	} {
		name := fmt.Sprintf("sampler %q ratio %v OTEL_TRACES_SAMPLER %q OTEL_TRACES_SAMPLER_ARG %q", c.sampler, c.ratio, c.env, c.arg)
		t.Setenv("OTEL_TRACES_SAMPLER", c.env)
		t.Setenv("OTEL_TRACES_SAMPLER_ARG", c.arg)
		tr, err := Start(context.Background(), Config{Endpoint: collector.URL, Sampler: c.sampler, Ratio: c.ratio, Name: "hipq"})
		if c.wantErrSubstring != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErrSubstring) {
				t.Errorf("%s: error %v, want one with %q", name, err, c.wantErrSubstring)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if c.wantDescribed != "" && !strings.Contains(tr.Sampler, c.wantDescribed) {
			t.Errorf("%s: sampler %s, want %s", name, tr.Sampler, c.wantDescribed)
		}
		if c.want != (sampled{}) || c.wantDescribed == "" {
			sampledIn := func(ctx context.Context) bool {
				_, span := tr.Tracer.Start(ctx, "s")
				defer span.End()
				return span.SpanContext().IsSampled()
			}
			got := sampled{sampledIn(context.Background()), sampledIn(parent(false)), sampledIn(parent(true))}
			if got != c.want {
				t.Errorf("%s: sampled (new trace, under an unsampled parent, under a sampled one) %+v, want %+v", name, got, c.want)
			}
		}
		if err := tr.Shutdown(context.Background()); err != nil {
			t.Errorf("%s: shutdown: %v", name, err)
		}
	}
	for old, note := range map[string]string{"parent_ratio": "parentbased_traceidratio", "always_on": "parentbased_always_on",
		"always_off": "parentbased_always_off"} {
		if got := SamplerNote(old); !strings.Contains(got, note) {
			t.Errorf("the warning for %s: %q, want it to name %s", old, got, note)
		}
	}
	if got := SamplerNote("parentbased_traceidratio"); got != "" {
		t.Errorf("a warning for parentbased_traceidratio: %q", got)
	}
}

package tracing

import (
	"context"
	"testing"

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

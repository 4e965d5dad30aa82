package api

import (
	"cmp"
	"context"
	"net"
	"net/http"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// ProbeConfig configures the probes: liveness, readiness and metrics.
type ProbeConfig struct {
	// Store is pinged and its schema checked.
	Store *store.Store
	// HotPath is the store whose writes readiness watches; nil = Store.
	HotPath *store.Store
	// WriteDeadline: readiness fails while a PostgreSQL write transaction
	// has run longer; defaults to DefaultWriteDeadline.
	WriteDeadline time.Duration
	// Ready reports what besides PostgreSQL readiness needs (Kafka); nil =
	// nothing.
	Ready func(context.Context) error
	// Stalled reports the consumers of this process waiting on a refusal
	// that is not their records' own; nil = none to report.
	Stalled func() error
	// Metrics are served at /metrics.
	Metrics *metrics.Metrics
}

// Probes serves GET /healthz, /readyz and /metrics, without a token, as
// the API does: what an instance that runs no API serves on its own
// listener (metrics.listen), so that every instance can be scraped and
// probed.
func Probes(cfg ProbeConfig) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", healthz)
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) { readyz(w, r, cfg) })
	mux.Handle("GET /metrics", metrics.Or(cfg.Metrics).Handler())
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusNotFound, map[string]any{"error": map[string]string{"code": "not_found",
			"message": "this listener serves only GET /healthz, /readyz and /metrics"}})
	})
	return mux
}

// ServeProbes serves Probes(cfg) on l until ctx ends, then shuts down.
func ServeProbes(ctx context.Context, log *zap.Logger, l net.Listener, cfg ProbeConfig) error {
	srv := &http.Server{Handler: Probes(cfg), ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute,
		IdleTimeout: 2 * time.Minute, ErrorLog: zap.NewStdLog(log)}
	return serveUntil(ctx, srv, l, "metrics listener", 5*time.Second)
}

func healthz(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// readyz answers 200 when PostgreSQL answers within 2s, no write of the
// hot path has run past the write deadline, the schema is current and
// cfg.Ready passes and no consumer is stalled; else 503, with each check's result.
func readyz(w http.ResponseWriter, r *http.Request, cfg ProbeConfig) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	checks := map[string]string{}
	ok := true
	check := func(name string, err error) {
		if err != nil {
			ok = false
			checks[name] = err.Error()
			return
		}
		checks[name] = "ok"
	}
	check("postgres", cfg.Store.Ping(ctx))
	hot := cmp.Or(cfg.HotPath, cfg.Store)
	check("writes", hot.WriteStalled(cmp.Or(cfg.WriteDeadline, DefaultWriteDeadline)))
	check("schema", cfg.Store.CheckSchema(ctx))
	if cfg.Ready != nil {
		check("kafka", cfg.Ready(ctx))
	}
	if cfg.Stalled != nil {
		check("consumers", cfg.Stalled())
	}
	status := http.StatusOK
	if !ok {
		status = http.StatusServiceUnavailable
	}
	writeJSON(w, status, map[string]any{"ready": ok, "checks": checks})
}

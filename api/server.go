// Package api is hipq's HTTP API (SPEC §10): the jobs API, the reply
// callback endpoint, queue pause and resume, dead letters, and the health
// endpoints.
//
// Every /v1 call needs a bearer token from api.tokens; with no tokens
// configured the server binds to loopback only. The callback endpoint also
// accepts the signature of its URL instead of a token, so a downstream
// needs no token. Errors are JSON: {"error": {"code": "...", "message": "..."}}.
package api

import (
	"cmp"
	"context"
	"crypto/subtle"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
)

// Defaults of the API.
const (
	DefaultListen         = "127.0.0.1:8080"
	DefaultMaxConns       = 4
	DefaultRequestTimeout = 10 * time.Second
	DefaultMaxBodyBytes   = 1 << 20
	DefaultWriteDeadline  = 10 * time.Second
)

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.Listen = cmp.Or(c.Listen, DefaultListen)
	c.MaxBodyBytes = cmp.Or(c.MaxBodyBytes, DefaultMaxBodyBytes)
	c.WriteDeadline = cmp.Or(c.WriteDeadline, DefaultWriteDeadline)
	c.RequestTimeout = cmp.Or(c.RequestTimeout, DefaultRequestTimeout)
	c.OperationLease = cmp.Or(c.OperationLease, DefaultOperationLease)
	c.OperationPoll = cmp.Or(c.OperationPoll, DefaultOperationPoll)
	c.OperationBatch = cmp.Or(c.OperationBatch, store.MaxOperationBatch)
	return c
}

// Config configures a Server.
type Config struct {
	Listen string
	// TLS, when set, serves HTTPS on Listen (its GetCertificate may read
	// a rotated certificate); nil: plain HTTP.
	TLS *tls.Config
	// Tokens are the admin role's bearer tokens; ReadTokens the read
	// role's (GET only). No tokens at all: no token needed (loopback only).
	Tokens         []string
	ReadTokens     []string
	CallbackSecret []byte
	// MaxBodyBytes bounds request bodies; defaults to DefaultMaxBodyBytes.
	MaxBodyBytes int
	// Queues are the declared queues (pause and resume refuse others).
	Queues []string
	Types  correlator.Types
	// Schedules are the configured periodic jobs.
	Schedules []*correlator.Schedule
	// Matchers read Kafka replies by topic, for dead-letter replays.
	Matchers map[string]correlator.Matcher
	// EarlyTTL is how long an early callback is kept (responses.early_ttl).
	EarlyTTL time.Duration
	// WriteDeadline: readiness fails while a PostgreSQL write transaction
	// has run longer; defaults to DefaultWriteDeadline.
	WriteDeadline time.Duration
	// Ready reports what besides PostgreSQL readiness needs (Kafka); nil =
	// nothing.
	Ready func(context.Context) error
	// Stalled reports the consumers of this process (consumer groups,
	// the outbox drainer) that wait because PostgreSQL refuses their
	// records for a reason that is not the records' own; readiness fails
	// naming them. nil = none.
	Stalled func() error
	// Metrics receives the API's counts and is served at /metrics (no
	// token needed); nil = counted but not served.
	Metrics *metrics.Metrics
	// DeadLetters copies refused callbacks to responses.dead_letter_topic;
	// nil = logged only.
	DeadLetters *deadletter.Copier
	// RequestTimeout bounds each request's work, its queries included;
	// defaults to DefaultRequestTimeout. A request past it is answered 503.
	RequestTimeout time.Duration
	// HotPath is the store of intake, dispatch and replies, whose writes
	// readiness watches; nil = the API's own.
	HotPath *store.Store
	// Tracer, when set, records each applied callback as a span in its
	// attempt's trace, and TracerProvider traces every request (a server
	// span, the parent of the job an enqueue makes); nil: no tracing work.
	Tracer         trace.Tracer
	TracerProvider trace.TracerProvider
	// UI is the dashboard at {prefix}/ui/; nil: none.
	UI *UIConfig
	// Instance names this process as the worker of bulk operations; ""
	// is a random name.
	Instance string
	// OperationLease is how long this process holds a bulk operation
	// after each of its batches; defaults to DefaultOperationLease.
	OperationLease time.Duration
	// OperationPoll is how often Run looks for bulk operations nobody
	// works; defaults to DefaultOperationPoll.
	OperationPoll time.Duration
	// OperationBatch is the most rows a batch of a bulk operation walks;
	// defaults to store.MaxOperationBatch, the most it may.
	OperationBatch int
}

// Server serves the API.
type Server struct {
	log *zap.Logger
	st  *store.Store
	cfg Config
	mux *http.ServeMux
	hub hub // long polls' wake-ups
	ops *operations
	// patterns are the ServeMux patterns route registered, in order: the
	// route table the OpenAPI document is checked against.
	patterns []string
}

// route registers h for a ServeMux pattern and records the pattern.
func (s *Server) route(pattern string, h http.Handler) {
	s.patterns = append(s.patterns, pattern)
	s.mux.Handle(pattern, h)
}

// New builds the server; Handler serves it, Run listens.
func New(log *zap.Logger, st *store.Store, cfg Config) *Server {
	cfg = cfg.WithDefaults()
	serveMetrics := cfg.Metrics != nil
	cfg.Metrics = metrics.Or(cfg.Metrics)
	s := &Server{log: log.Named("api"), st: st, cfg: cfg, mux: http.NewServeMux()}
	s.ops = newOperations(s)
	auth := s.authorized
	s.route("PUT /v1/jobs/{job_type}/{job_key}", auth(s.enqueue))
	s.route("GET /v1/jobs/{job_type}/{job_key}", auth(s.getJob))
	s.route("GET /v1/jobs", auth(s.listJobs))
	s.route("POST /v1/jobs/cancel", auth(s.bulk(store.OperationCancel)))
	s.route("POST /v1/jobs/replay", auth(s.bulk(store.OperationReplay)))
	s.route("POST /v1/jobs/run-now", auth(s.bulk(store.OperationRunNow)))
	s.route("POST /v1/jobs/{job_type}/{job_key}/cancel", auth(s.cancel))
	s.route("POST /v1/jobs/{job_type}/{job_key}/replay", auth(s.replay))
	s.route("POST /v1/jobs/{job_type}/{job_key}/response", s.handle(s.callback))   // signature or token, checked inside
	s.route("POST /v1/jobs/{job_type}/{job_key}/heartbeat", s.handle(s.heartbeat)) // signature, checked inside
	s.route("GET /v1/queues", auth(s.listQueues))
	s.route("POST /v1/queues/{queue}/pause", auth(s.pause(true)))
	s.route("POST /v1/queues/{queue}/resume", auth(s.pause(false)))
	s.route("GET /v1/schedules", auth(s.listSchedules))
	s.route("POST /v1/schedules/{name}/pause", auth(s.pauseSchedule(true)))
	s.route("POST /v1/schedules/{name}/resume", auth(s.pauseSchedule(false)))
	s.route("POST /v1/schedules/{name}/trigger", auth(s.triggerSchedule))
	s.route("GET /v1/dead-letters", auth(s.listDeadLetters))
	s.route("POST /v1/dead-letters/{id}/replay", auth(s.replayDeadLetter))
	s.route("POST /v1/dead-letters/replay", auth(s.bulk(store.OperationDeadLetterReplay)))
	s.route("GET /v1/operations/{id}", auth(s.getOperation))
	s.route("DELETE /v1/operations/{id}", auth(s.stopOperation))
	s.route("GET /v1/openapi.yaml", auth(openapi("application/yaml", openapiYAML)))
	s.route("GET /v1/openapi.json", auth(openapi("application/json", openapiJSON)))
	s.route("GET /healthz", http.HandlerFunc(healthz))
	s.route("GET /readyz", s.handle(s.readyz))
	if serveMetrics {
		s.route("GET /metrics", cfg.Metrics.Handler())
	}
	if cfg.UI != nil {
		s.mountUI(*cfg.UI)
	}
	s.route("/", s.handle(func(w http.ResponseWriter, r *http.Request) error {
		return errorf(http.StatusNotFound, "not_found", "no such endpoint: %s %s", r.Method, r.URL.Path)
	}))
	return s
}

// Handler serves the API.
func (s *Server) Handler() http.Handler {
	if s.cfg.TracerProvider == nil {
		return s.mux
	}
	return otelhttp.NewHandler(s.mux, "hipq api", otelhttp.WithTracerProvider(s.cfg.TracerProvider),
		otelhttp.WithPropagators(tracing.Propagator),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string { return r.Method + " " + apiRoute(r) }))
}

// apiRoute names a request's route for its span, without its job's
// type, key or ids.
func apiRoute(r *http.Request) string {
	p := r.URL.Path
	switch {
	case slices.Contains([]string{"/v1/jobs/cancel", "/v1/jobs/replay", "/v1/jobs/run-now", "/v1/dead-letters/replay"}, p):
		return p
	case strings.HasPrefix(p, "/v1/operations/"):
		return "/v1/operations/{id}"
	case strings.HasSuffix(p, "/response"):
		return "/v1/jobs/{job_type}/{job_key}/response"
	case strings.HasPrefix(p, "/v1/jobs/"):
		return "/v1/jobs/{job_type}/{job_key}"
	case strings.HasPrefix(p, "/v1/dead-letters/"):
		return "/v1/dead-letters/{id}"
	case strings.HasPrefix(p, "/v1/queues/"):
		return "/v1/queues/{queue}"
	}
	return p
}

// Run listens on cfg.Listen until ctx ends, then shuts down gracefully.
// With no tokens configured it listens on loopback only. It works the bulk
// operations nobody works meanwhile (RunOperations).
func (s *Server) Run(ctx context.Context) error {
	addr := s.cfg.Listen
	if len(s.cfg.Tokens) == 0 {
		addr = loopbackOnly(addr)
		s.log.Warn("api.tokens is empty: the API needs no token and listens on loopback only", zap.String("listen", addr))
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("api: listen on %s: %w", addr, err)
	}
	srv := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute,
		IdleTimeout: 2 * time.Minute, ErrorLog: zap.NewStdLog(s.log), TLSConfig: s.cfg.TLS}
	s.log.Info("api listening", zap.String("addr", l.Addr().String()), zap.Bool("tls", s.cfg.TLS != nil))
	octx, stop := context.WithCancel(ctx)
	ops := make(chan error, 1)
	go func() { ops <- s.RunOperations(octx) }()
	err = serveUntil(ctx, srv, l, "api", 10*time.Second)
	stop()
	return errors.Join(err, <-ops)
}

// serveUntil serves srv on l until ctx ends, then shuts it down, waiting
// up to grace for the requests under way; name prefixes its errors. With
// srv.TLSConfig it serves HTTPS, with the certificates that config gives.
func serveUntil(ctx context.Context, srv *http.Server, l net.Listener, name string, grace time.Duration) error {
	done := make(chan error, 1)
	go func() {
		if srv.TLSConfig != nil {
			done <- srv.ServeTLS(l, "", "")
			return
		}
		done <- srv.Serve(l)
	}()
	select {
	case err := <-done:
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return fmt.Errorf("%s: %w", name, err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), grace)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("%s: shutdown: %w", name, err)
	}
	return nil
}

// loopbackOnly keeps the port of addr and replaces a host that is not a
// loopback address with 127.0.0.1.
func loopbackOnly(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "127.0.0.1:8080"
	}
	if ip := net.ParseIP(host); host == "localhost" || ip != nil && ip.IsLoopback() {
		return addr
	}
	return net.JoinHostPort("127.0.0.1", port)
}

// apiError is an error with its HTTP status and code.
type apiError struct {
	Status  int
	Code    string
	Message string
}

func (e *apiError) Error() string { return e.Code + ": " + e.Message }

func errorf(status int, code, format string, args ...any) *apiError {
	return &apiError{Status: status, Code: code, Message: fmt.Sprintf(format, args...)}
}

// handle turns an error-returning handler into an http.Handler writing
// JSON errors; unexpected errors are logged and answered 500 without
// detail.
func (s *Server) handle(h func(http.ResponseWriter, *http.Request) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), s.cfg.RequestTimeout)
		defer cancel()
		// A long poll waits past the request timeout: it finds the request's
		// own context here, and bounds each statement by the timeout still.
		r = r.WithContext(context.WithValue(ctx, requestCtxKey{}, r.Context()))
		err := h(w, r)
		if err == nil {
			return
		}
		var ae *apiError
		if !errors.As(err, &ae) {
			ae = &apiError{Status: http.StatusInternalServerError, Code: "internal", Message: "internal error; see hipq's log"}
			switch {
			case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || isStatementTimeout(err):
				ae = &apiError{Status: http.StatusServiceUnavailable, Code: "unavailable",
					Message: fmt.Sprintf("PostgreSQL did not answer within the request timeout (%v); try again", s.cfg.RequestTimeout)}
			case store.IsTransient(err):
				ae = &apiError{Status: http.StatusServiceUnavailable, Code: "unavailable",
					Message: "PostgreSQL is unreachable or busy; try again"}
			case store.SQLState(err) != "" && !store.IsDataError(err):
				// Refused for a reason that is not the request's (a
				// privilege revoked, a column renamed, a failing
				// trigger): the same request may well pass once the
				// system is mended, so the caller keeps it and tries
				// again. A callback is never dead-lettered for it.
				ae = &apiError{Status: http.StatusServiceUnavailable, Code: "unavailable",
					Message: fmt.Sprintf("PostgreSQL refused the write for a reason that is not the request's (SQLSTATE %s); try again later", store.SQLState(err))}
			}
			s.log.Error("api call failed", append(tracing.LogFields(r.Context()), zap.String("method", r.Method),
				zap.String("path", correlator.Clip(r.URL.Path, 512)), zap.String("error", correlator.Clip(err.Error(), 2048)))...)
		}
		writeJSON(w, ae.Status, map[string]any{"error": map[string]string{"code": ae.Code, "message": ae.Message}})
	})
}

type requestCtxKey struct{}

// isStatementTimeout: PostgreSQL cancelled a statement past the API
// connections' statement_timeout.
func isStatementTimeout(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "57014"
}

// authorized requires a valid bearer token when tokens are configured,
// before anything of the request is looked at: a caller without one learns
// nothing of what is wrong with its input. Then the path's names are
// checked against their limits.
func (s *Server) authorized(h func(http.ResponseWriter, *http.Request) error) http.Handler {
	return s.handle(func(w http.ResponseWriter, r *http.Request) error {
		switch s.bearerRole(r) {
		case roleNone:
			w.Header().Set("WWW-Authenticate", `Bearer realm="hipq"`)
			return errorf(http.StatusUnauthorized, "unauthorized", "a valid bearer token is required (Authorization: Bearer <token>)")
		case roleRead:
			if r.Method != http.MethodGet && r.Method != http.MethodHead {
				return errorf(http.StatusForbidden, "forbidden", "this token has the read role: it may only GET (admin tokens are api.tokens)")
			}
		}
		if err := checkPath(r); err != nil {
			return err
		}
		return h(w, r)
	})
}

// checkPath refuses path values hipq could not store: job_type and
// job_key over their limits, or not valid UTF-8 text; a queue name
// likewise.
func checkPath(r *http.Request) error {
	limits := map[string]int{"job_type": correlator.MaxJobTypeBytes, "job_key": correlator.MaxJobKeyBytes, "queue": correlator.MaxJobTypeBytes}
	for _, name := range []string{"job_type", "job_key", "queue"} {
		if v := r.PathValue(name); v != "" {
			if err := correlator.CheckName(name, v, limits[name]); err != nil {
				return inputError(err)
			}
		}
	}
	return nil
}

// Roles of a token: admin reads and changes, read only reads.
type role int

const (
	roleNone role = iota
	roleRead
	roleAdmin
)

// bearerRole is the role of the request's bearer token.
func (s *Server) bearerRole(r *http.Request) role {
	token, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return s.roleOf(token)
}

// roleOf is the role of a bearer token, compared with every configured
// one in constant time. With no tokens configured everyone is admin (the
// API then listens on loopback only).
func (s *Server) roleOf(token string) role {
	if len(s.cfg.Tokens) == 0 {
		return roleAdmin
	}
	if token == "" {
		return roleNone
	}
	admin, read := 0, 0
	for _, t := range s.cfg.Tokens {
		admin |= subtle.ConstantTimeCompare([]byte(token), []byte(t))
	}
	for _, t := range s.cfg.ReadTokens {
		read |= subtle.ConstantTimeCompare([]byte(token), []byte(t))
	}
	switch {
	case admin == 1:
		return roleAdmin
	case read == 1:
		return roleRead
	}
	return roleNone
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// readBody reads a request body within the size limit.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, int64(s.cfg.MaxBodyBytes)))
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return nil, errorf(http.StatusRequestEntityTooLarge, correlator.CodeTooLarge, "the body is larger than %d bytes", mbe.Limit)
	}
	if err != nil {
		return nil, errorf(http.StatusBadRequest, "bad_body", "reading the body: %v", err)
	}
	return b, nil
}

func (s *Server) readyz(w http.ResponseWriter, r *http.Request) error {
	readyz(w, r, ProbeConfig{Store: s.st, HotPath: s.cfg.HotPath, WriteDeadline: s.cfg.WriteDeadline, Ready: s.cfg.Ready,
		Stalled: s.cfg.Stalled})
	return nil
}

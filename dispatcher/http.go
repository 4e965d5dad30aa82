package dispatcher

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
)

// HTTPRoute is how one job type's requests are called (SPEC §5).
type HTTPRoute struct {
	// URL may hold {job_type} and {job_key}, replaced path-escaped.
	URL      string
	Method   string // defaults to DefaultHTTPMethod
	Headers  map[string]string
	Timeout  time.Duration // of one call; defaults to DefaultHTTPTimeout
	Sync     bool          // a 2xx body is the reply
	Delivery correlator.Delivery
	// MaxInFlight bounds this type's calls at once; defaults to the
	// sender's MaxInFlight. A slow downstream holds its own types' slots,
	// never another type's.
	MaxInFlight int
	// TLS, when set, is the TLS of this type's calls (the CA of a
	// downstream's private certificate, a client certificate): they get
	// a connection pool of their own. nil: the sender's client, trusting
	// the system's roots.
	TLS *tls.Config
}

// HTTPMode says where an HTTP type's reply comes from.
type HTTPMode string

// HTTP modes.
const (
	// HTTPAsync: the reply comes later, to the callback URL (the default).
	HTTPAsync HTTPMode = "async"
	// HTTPSync: a 2xx answer's body is the reply.
	HTTPSync HTTPMode = "sync"
)

// Defaults of the HTTP transport.
const (
	DefaultHTTPMethod        = http.MethodPost
	DefaultHTTPTimeout       = 10 * time.Second
	DefaultHTTPMaxInFlight   = 64
	DefaultHTTPMaxReplyBytes = 1 << 20
)

// WithDefaults returns c with every unset field at its default.
func (c HTTPSenderConfig) WithDefaults() HTTPSenderConfig {
	c.MaxInFlight = cmp.Or(c.MaxInFlight, DefaultHTTPMaxInFlight)
	c.MaxReplyBytes = cmp.Or(c.MaxReplyBytes, DefaultHTTPMaxReplyBytes)
	return c
}

// HTTPSenderConfig configures an HTTPSender.
type HTTPSenderConfig struct {
	Routes map[string]HTTPRoute // by job type
	// PublicURL and CallbackSecret make the Hipq-Callback-Url header; with
	// no PublicURL none is sent.
	PublicURL      string
	CallbackSecret []byte
	// MaxInFlight bounds each job type's calls in flight at once, unless
	// its route says otherwise; defaults to DefaultHTTPMaxInFlight.
	MaxInFlight int
	// MaxReplyBytes bounds a sync reply body; defaults to
	// DefaultHTTPMaxReplyBytes.
	MaxReplyBytes int
	// Client defaults to a pooled client that does not follow redirects.
	// Routes with TLS of their own get such a client each, whatever this
	// says.
	Client *http.Client
	// StartWithin, when set, is how soon after its claim a call must start:
	// a call still waiting for a slot then is not made (NotSent: the claim
	// is undone). Set it below dispatch.grace, so that a call never runs
	// while the sweeper takes its claim for dead (claim + timeout + grace).
	// It is measured on this process's monotonic clock from before the
	// claim was asked for, so no wall clock, this host's or PostgreSQL's,
	// enters it.
	StartWithin time.Duration
	// TracerProvider, when set, traces each call (an HTTP client span, a
	// child of the job's send span); nil: no tracing work.
	TracerProvider trace.TracerProvider
}

// HTTPSender calls downstream URLs, many at once within each type's
// MaxInFlight.
type HTTPSender struct {
	cfg    HTTPSenderConfig
	client *http.Client
	// clients are the clients of the routes with TLS of their own, by
	// job type, made on first use (under mu).
	clients map[string]*http.Client
	matcher correlator.Matcher
	mu      sync.Mutex
	slots   map[string]chan struct{} // by job type, made on first use
}

// NewHTTPSender builds a sender for the routed job types.
func NewHTTPSender(cfg HTTPSenderConfig) *HTTPSender {
	cfg = cfg.WithDefaults()
	client := cfg.Client
	if client == nil {
		client = newHTTPClient(cfg, nil)
	}
	m := correlator.DefaultMatcher()
	m.MaxBytes = cfg.MaxReplyBytes
	return &HTTPSender{cfg: cfg, client: client, clients: map[string]*http.Client{}, slots: map[string]chan struct{}{}, matcher: m}
}

// clientFor is the client of a job type's calls: its own for a route with
// TLS of its own (made on first use: the routes may be filled in after
// NewHTTPSender), else the sender's.
func (s *HTTPSender) clientFor(jobType string, r HTTPRoute) *http.Client {
	if r.TLS == nil {
		return s.client
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.clients[jobType]
	if !ok {
		c = newHTTPClient(s.cfg, r.TLS)
		s.clients[jobType] = c
	}
	return c
}

// newHTTPClient is a pooled client that does not follow redirects, with tc
// as its TLS (nil: the system's roots).
func newHTTPClient(cfg HTTPSenderConfig, tc *tls.Config) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = cfg.MaxInFlight
	tr.MaxConnsPerHost = 0       // the types' slots bound the calls
	tr.ResponseHeaderTimeout = 0 // each call has its own deadline
	if tc != nil {
		tr.TLSClientConfig = tc
	}
	var rt http.RoundTripper = tr
	if cfg.TracerProvider != nil {
		rt = otelhttp.NewTransport(tr, otelhttp.WithTracerProvider(cfg.TracerProvider), otelhttp.WithPropagators(tracing.Propagator))
	}
	return &http.Client{Transport: rt, CheckRedirect: func(*http.Request, []*http.Request) error {
		// A redirect of a POST would turn it into a GET: the URL is wrong.
		return http.ErrUseLastResponse
	}}
}

// slot is the job type's call slots; ok is false for a type with no route.
func (s *HTTPSender) slot(jobType string) (chan struct{}, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c, ok := s.slots[jobType]; ok {
		return c, true
	}
	r, ok := s.cfg.Routes[jobType]
	if !ok {
		return nil, false
	}
	n := r.MaxInFlight
	if n <= 0 {
		n = s.cfg.MaxInFlight
	}
	c := make(chan struct{}, n)
	s.slots[jobType] = c
	return c, true
}

// Route says where a job type's calls go: the downstream host, backed off
// apart from every other host.
func (s *HTTPSender) Route(jobType string) Route {
	r, ok := s.cfg.Routes[jobType]
	if !ok {
		return Route{Neighbour: "http (no route for " + jobType + ")"}
	}
	slot, _ := s.slot(jobType)
	return Route{Neighbour: "http " + r.host(), Destination: r.host(), Timeout: r.timeout(), MaxInFlight: cap(slot)}
}

// host is the scheme and host of the route's URL, placeholders filled.
func (r HTTPRoute) host() string {
	u, err := url.Parse(r.RequestURL("x", "x"))
	if err != nil || u.Host == "" {
		return "(bad URL)"
	}
	return u.Scheme + "://" + u.Host
}

func (r HTTPRoute) timeout() time.Duration { return cmp.Or(r.Timeout, DefaultHTTPTimeout) }

// Send calls every job's URL concurrently (within its type's MaxInFlight
// across all of the sender's batches) and returns when all calls are done.
// A call that cannot get a slot within StartWithin of its claim is not made.
func (s *HTTPSender) Send(ctx context.Context, jobs []store.Claimed) []Result {
	out := make([]Result, len(jobs))
	var wg sync.WaitGroup
	for i := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &jobs[i]
			slot, ok := s.slot(c.JobType)
			if !ok {
				out[i] = Result{Status: NotSent, Err: fmt.Errorf("no HTTP route for job type %q", c.JobType)}
				return
			}
			if !s.acquire(slot, c) {
				out[i] = Result{Status: NotSent, Err: fmt.Errorf("not sent: no free call slot within %v of the claim (downstream slow; %d calls of this type at once at most)",
					s.cfg.StartWithin, cap(slot))}
				return
			}
			defer func() { <-slot }()
			out[i] = s.call(ctx, c)
		}()
	}
	wg.Wait()
	return out
}

// acquire takes a call slot for c, waiting no later than StartWithin after
// its claim; false: none came in time.
func (s *HTTPSender) acquire(slot chan struct{}, c *store.Claimed) bool {
	if s.cfg.StartWithin <= 0 {
		slot <- struct{}{}
		return true
	}
	left := s.cfg.StartWithin - time.Since(c.ClaimedLocal)
	if left <= 0 {
		return false
	}
	t := time.NewTimer(left)
	defer t.Stop()
	select {
	case slot <- struct{}{}:
	case <-t.C:
		return false
	}
	if time.Since(c.ClaimedLocal) > s.cfg.StartWithin {
		<-slot // both were ready: late wins
		return false
	}
	return true
}

// RequestURL is the URL of a job's call: the route's with {job_type} and
// {job_key} replaced, path-escaped.
func (r HTTPRoute) RequestURL(jobType, jobKey string) string {
	return strings.NewReplacer("{job_type}", url.PathEscape(jobType), "{job_key}", url.PathEscape(jobKey)).Replace(r.URL)
}

func (s *HTTPSender) call(ctx context.Context, c *store.Claimed) Result {
	route := s.cfg.Routes[c.JobType]
	method := cmp.Or(route.Method, DefaultHTTPMethod)
	ctx, cancel := context.WithTimeout(ctx, route.timeout())
	defer cancel()
	if c.Trace != nil {
		ctx = tracing.Propagator.Extract(ctx, propagation.MapCarrier(c.Trace)) // the client span's parent: the send span
	}
	target := route.RequestURL(c.JobType, c.JobKey)
	shown := RedactURL(target) // errors are stored and logged: never a secret of the URL's
	req, err := http.NewRequestWithContext(ctx, method, target, bytes.NewReader(c.JobData))
	if err != nil {
		return Result{Status: Failed, Final: true, Err: fmt.Errorf("build request for %s: %v", shown, redactErr(err, target, shown))}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "hipq")
	for k, v := range route.Headers {
		req.Header.Set(k, v)
	}
	req.Header.Set("Hipq-Job-Type", c.JobType)
	req.Header.Set("Hipq-Job-Key", c.JobKey)
	req.Header.Set("Hipq-Attempt", strconv.Itoa(c.Attempt))
	req.Header.Set("Hipq-Job-Id", strconv.FormatInt(c.ID, 10))
	for k, v := range c.Trace {
		req.Header.Set(k, v)
	}
	if s.cfg.PublicURL != "" {
		req.Header.Set("Hipq-Callback-Url", correlator.CallbackURL(s.cfg.PublicURL, s.cfg.CallbackSecret, c.ID, c.JobType, c.JobKey, c.Attempt))
		req.Header.Set("Hipq-Heartbeat-Url", correlator.HeartbeatURL(s.cfg.PublicURL, s.cfg.CallbackSecret, c.ID, c.JobType, c.JobKey, c.Attempt))
	}
	var wrote atomic.Bool // (the request's headers went out on a connection)
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{WroteHeaders: func() { wrote.Store(true) }}))
	resp, err := s.clientFor(c.JobType, route).Do(req)
	if err != nil {
		return classifyCallError(method, target, shown, err, route.Delivery, wrote.Load())
	}
	defer resp.Body.Close()
	body, readErr := io.ReadAll(io.LimitReader(resp.Body, int64(s.cfg.MaxReplyBytes)+1))
	status := fmt.Sprintf("%s %s: HTTP %s", method, shown, resp.Status)
	switch code := resp.StatusCode; {
	case code >= 200 && code < 300:
		if !route.Sync {
			return Result{Status: Sent}
		}
		if readErr != nil {
			// It answered 2xx, then the body broke off: the request arrived.
			r := classifyCallError(method, target, shown, readErr, route.Delivery, true)
			r.Status, r.Answered = Failed, true
			return r
		}
		reply, err := s.matcher.Match(&correlator.Record{Value: body, Headers: []correlator.Header{
			{Key: correlator.HeaderJobID, Value: []byte(strconv.FormatInt(c.ID, 10))},
			{Key: correlator.HeaderJobType, Value: []byte(c.JobType)},
			{Key: correlator.HeaderJobKey, Value: []byte(c.JobKey)},
			{Key: correlator.HeaderAttempt, Value: []byte(strconv.Itoa(c.Attempt))},
		}})
		if err != nil {
			// The downstream answered, but not with a reply hipq can read.
			return Result{Status: Failed, Answered: true, Final: route.Delivery == correlator.AtMostOnce,
				Err: fmt.Errorf("%s, but its reply cannot be read: %w", status, err)}
		}
		return Result{Status: Sent, Reply: reply}
	case code == http.StatusRequestTimeout || code == http.StatusTooManyRequests:
		return Result{Status: Failed, Answered: true, Err: errors.New(status + snippet(body)), RetryAfter: retryAfter(resp)}
	case code >= 500:
		// The downstream failed; for at_most_once it may have acted first.
		return Result{Status: Failed, Answered: true, Final: route.Delivery == correlator.AtMostOnce, Err: errors.New(status + snippet(body)),
			RetryAfter: retryAfter(resp)}
	default: // other 4xx, and 1xx/3xx a downstream should not answer
		return Result{Status: Failed, Answered: true, Final: true, Err: errors.New(status + snippet(body))}
	}
}

// retryAfter reads a 429's or 503's Retry-After header; one that cannot be
// read says nothing (the policy's backoff applies).
func retryAfter(resp *http.Response) correlator.RetryAfter {
	if resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode != http.StatusServiceUnavailable {
		return correlator.RetryAfter{}
	}
	ra, _ := correlator.ParseRetryAfter(resp.Header.Get("Retry-After"))
	return ra
}

// classifyCallError: a refused connection (or a name that does not
// resolve) never delivered the request: the downstream host is out, like a
// broker refusing (Refused: undone, the host backs off). So did a TLS
// handshake that failed on hipq's side (it does not trust the host's
// certificate), and one the host refused with an alert before hipq wrote
// the request (wrote: its headers went out), or with an alert about the
// handshake itself (hipq's certificate refused, missing, expired; no
// common parameters), which a TLS stack sends before any request is read:
// with TLS 1.3 hipq may have written the request before the host's verdict
// on its certificate came, unread. Any other alert after the request went
// out, a timeout or a connection lost may have delivered it, so
// at_most_once types end final.
func classifyCallError(method, target, shown string, err error, delivery correlator.Delivery, wrote bool) Result {
	cause := unwrapURLError(err)
	err = fmt.Errorf("%s %s: %v", method, shown, redactErr(cause, target, shown))
	var (
		dnsErr     *net.DNSError
		unverified *tls.CertificateVerificationError
		alert      *net.OpError
	)
	if errors.Is(cause, syscall.ECONNREFUSED) || errors.As(cause, &dnsErr) || errors.As(cause, &unverified) ||
		errors.As(cause, &alert) && alert.Op == "remote error" && (!wrote || handshakeAlert(alert.Err)) {
		return Result{Status: Refused, Err: err}
	}
	return Result{Status: Failed, Final: delivery == correlator.AtMostOnce, Err: err}
}

// handshakeAlerts are the TLS alerts a host sends about the handshake, as
// Go writes them: never once the host has read a request.
var handshakeAlerts = []string{"tls: bad certificate", "tls: unsupported certificate", "tls: revoked certificate",
	"tls: expired certificate", "tls: unknown certificate", "tls: unknown certificate authority", "tls: certificate required",
	"tls: handshake failure", "tls: protocol version not supported", "tls: insufficient security level",
	"tls: no application protocol", "tls: unrecognized name"}

// handshakeAlert says whether a remote alert is about the handshake.
func handshakeAlert(err error) bool {
	return err != nil && slices.Contains(handshakeAlerts, err.Error())
}

// RedactURL is a URL fit to store and log: a password in it is replaced
// and the query's values (where API keys go) are left out.
func RedactURL(target string) string {
	u, err := url.Parse(target)
	if err != nil {
		return "(unparsable URL)"
	}
	if u.RawQuery != "" {
		q := u.Query()
		for k := range q {
			q[k] = []string{"REDACTED"}
		}
		u.RawQuery = q.Encode()
	}
	u.Fragment, u.RawFragment = "", ""
	return u.Redacted()
}

// redactErr is err's text with the URL, should it hold it, redacted.
func redactErr(err error, target, shown string) string {
	text := err.Error()
	if target != shown {
		text = strings.ReplaceAll(text, target, shown)
		if u, perr := url.Parse(target); perr == nil {
			if p, ok := u.User.Password(); ok && p != "" {
				text = strings.ReplaceAll(text, p, "xxxxx")
			}
		}
	}
	return text
}

// unwrapURLError drops the *url.Error wrapper, which repeats method and URL.
func unwrapURLError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		if ue.Timeout() {
			return fmt.Errorf("no answer within the timeout: %w", ue.Err)
		}
		return ue.Err
	}
	return err
}

// snippet is the start of a response body, for error messages.
func snippet(body []byte) string {
	const n = 200
	if len(body) == 0 {
		return ""
	}
	if len(body) > n {
		body = body[:n]
		for len(body) > 0 && !utf8.Valid(body) {
			body = body[:len(body)-1]
		}
		return ": " + string(body) + "…"
	}
	return ": " + string(body)
}

// Transport names it in metrics.
func (s *HTTPSender) Transport() string { return "http" }

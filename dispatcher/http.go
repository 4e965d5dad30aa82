package dispatcher

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

// HTTPRoute is how one job type's requests are called (SPEC §5).
type HTTPRoute struct {
	// URL may hold {job_type} and {job_key}, replaced path-escaped.
	URL      string
	Method   string // defaults to POST
	Headers  map[string]string
	Timeout  time.Duration // of one call; defaults to 10s
	Sync     bool          // a 2xx body is the reply
	Delivery correlator.Delivery
}

// HTTPSenderConfig configures an HTTPSender.
type HTTPSenderConfig struct {
	Routes map[string]HTTPRoute // by job type
	// PublicURL and CallbackSecret make the Hipq-Callback-Url header; with
	// no PublicURL none is sent.
	PublicURL      string
	CallbackSecret []byte
	// MaxInFlight bounds the calls in flight at once; defaults to 64.
	MaxInFlight int
	// MaxReplyBytes bounds a sync reply body; defaults to 1 MiB.
	MaxReplyBytes int
	// Client defaults to a pooled client that does not follow redirects.
	Client *http.Client
	// StartWithin, when set, is how soon after its claim a call must start:
	// a call still waiting for a slot then is not made (NotSent: the claim
	// is undone). Set it below dispatch.grace, so that a call never runs
	// while the sweeper takes its claim for dead (claim + timeout + grace).
	StartWithin time.Duration
}

// HTTPSender calls downstream URLs, many at once within MaxInFlight.
type HTTPSender struct {
	cfg     HTTPSenderConfig
	client  *http.Client
	sem     chan struct{}
	matcher correlator.Matcher
}

// NewHTTPSender builds a sender for the routed job types.
func NewHTTPSender(cfg HTTPSenderConfig) *HTTPSender {
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = 64
	}
	if cfg.MaxReplyBytes <= 0 {
		cfg.MaxReplyBytes = 1 << 20
	}
	client := cfg.Client
	if client == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConnsPerHost = cfg.MaxInFlight
		tr.MaxConnsPerHost = cfg.MaxInFlight
		tr.ResponseHeaderTimeout = 0 // each call has its own deadline
		client = &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error {
			// A redirect of a POST would turn it into a GET: the URL is wrong.
			return http.ErrUseLastResponse
		}}
	}
	m := correlator.DefaultMatcher()
	m.MaxBytes = cfg.MaxReplyBytes
	return &HTTPSender{cfg: cfg, client: client, sem: make(chan struct{}, cfg.MaxInFlight), matcher: m}
}

// Send calls every job's URL concurrently (within MaxInFlight across all
// of the sender's batches) and returns when all calls are done.
func (s *HTTPSender) Send(ctx context.Context, jobs []store.Claimed) []Result {
	out := make([]Result, len(jobs))
	done := make(chan struct{}, len(jobs))
	for i := range jobs {
		s.sem <- struct{}{}
		go func() {
			defer func() { <-s.sem; done <- struct{}{} }()
			out[i] = s.call(ctx, &jobs[i])
		}()
	}
	for range jobs {
		<-done
	}
	return out
}

// RequestURL is the URL of a job's call: the route's with {job_type} and
// {job_key} replaced, path-escaped.
func (r HTTPRoute) RequestURL(jobType, jobKey string) string {
	return strings.NewReplacer("{job_type}", url.PathEscape(jobType), "{job_key}", url.PathEscape(jobKey)).Replace(r.URL)
}

func (s *HTTPSender) call(ctx context.Context, c *store.Claimed) Result {
	route, ok := s.cfg.Routes[c.JobType]
	if !ok {
		return Result{Status: NotSent, Err: fmt.Errorf("no HTTP route for job type %q", c.JobType)}
	}
	if s.cfg.StartWithin > 0 && time.Since(c.StartedAt) > s.cfg.StartWithin {
		return Result{Status: NotSent, Err: fmt.Errorf("not sent: no free call slot within %v of the claim (downstream slow; %d calls at once at most)",
			s.cfg.StartWithin, s.cfg.MaxInFlight)}
	}
	method := route.Method
	if method == "" {
		method = http.MethodPost
	}
	timeout := route.Timeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	target := route.RequestURL(c.JobType, c.JobKey)
	req, err := http.NewRequestWithContext(ctx, method, target, bytes.NewReader(c.JobData))
	if err != nil {
		return Result{Status: Failed, Final: true, Err: fmt.Errorf("build request: %w", err)}
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
	if s.cfg.PublicURL != "" {
		req.Header.Set("Hipq-Callback-Url", correlator.CallbackURL(s.cfg.PublicURL, s.cfg.CallbackSecret, c.ID, c.JobType, c.JobKey, c.Attempt))
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return classifyCallError(method, target, err, route.Delivery)
	}
	defer resp.Body.Close()
	body, readErr := io.ReadAll(io.LimitReader(resp.Body, int64(s.cfg.MaxReplyBytes)+1))
	status := fmt.Sprintf("%s %s: HTTP %s", method, target, resp.Status)
	switch code := resp.StatusCode; {
	case code >= 200 && code < 300:
		if !route.Sync {
			return Result{Status: Sent}
		}
		if readErr != nil {
			return classifyCallError(method, target, readErr, route.Delivery)
		}
		reply, err := s.matcher.Match(&correlator.Record{Value: body, Headers: []correlator.Header{
			{Key: correlator.HeaderJobID, Value: []byte(strconv.FormatInt(c.ID, 10))},
			{Key: correlator.HeaderJobType, Value: []byte(c.JobType)},
			{Key: correlator.HeaderJobKey, Value: []byte(c.JobKey)},
			{Key: correlator.HeaderAttempt, Value: []byte(strconv.Itoa(c.Attempt))},
		}})
		if err != nil {
			// The downstream answered, but not with a reply hipq can read.
			return Result{Status: Failed, Final: route.Delivery == correlator.AtMostOnce,
				Err: fmt.Errorf("%s, but its reply cannot be read: %w", status, err)}
		}
		return Result{Status: Sent, Reply: reply}
	case code == http.StatusRequestTimeout || code == http.StatusTooManyRequests:
		return Result{Status: Failed, Err: errors.New(status + snippet(body))}
	case code >= 500:
		// The downstream failed; for at_most_once it may have acted first.
		return Result{Status: Failed, Final: route.Delivery == correlator.AtMostOnce, Err: errors.New(status + snippet(body))}
	default: // other 4xx, and 1xx/3xx a downstream should not answer
		return Result{Status: Failed, Final: true, Err: errors.New(status + snippet(body))}
	}
}

// classifyCallError: a refused connection (or a name that does not
// resolve) never delivered the request, so it is retryable for every type;
// a timeout or a connection lost may have delivered it, so at_most_once
// types end final.
func classifyCallError(method, target string, err error, delivery correlator.Delivery) Result {
	err = fmt.Errorf("%s %s: %w", method, target, unwrapURLError(err))
	var dnsErr *net.DNSError
	if errors.Is(err, syscall.ECONNREFUSED) || errors.As(err, &dnsErr) {
		return Result{Status: Failed, Err: err}
	}
	return Result{Status: Failed, Final: delivery == correlator.AtMostOnce, Err: err}
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

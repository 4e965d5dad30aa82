// Package client is hipq's Go client for producers: it enqueues jobs,
// reads, cancels and replays them, lists them and waits for them to end,
// over hipq's HTTP API. It uses the standard library only, so a producer's
// build pulls in none of the server's dependencies.
//
//	c := client.New("http://hipq:8080", client.WithToken(os.Getenv("HIPQ_API_TOKEN")))
//	row, created, err := c.Enqueue(ctx, client.Job{Type: "invoice.ship", Key: "shp_123", Data: data})
//	...
//	final, err := c.Wait(ctx, row.Ref())
package client

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
)

// Client calls one hipq API.
type Client struct {
	base   string
	token  string
	http   *http.Client
	caFile string
	// err is a configuration error (a CA file that cannot be read),
	// returned by every call.
	err error
}

// Option configures a Client.
type Option func(*Client)

// WithToken sends a bearer token (one of the API's api.tokens).
func WithToken(token string) Option { return func(c *Client) { c.token = token } }

// WithHTTPClient makes the calls with hc instead of http.DefaultClient.
// Wait's long polls last up to 30 s: a Timeout of hc shorter than that
// makes them fail and be tried again.
func WithHTTPClient(hc *http.Client) Option { return func(c *Client) { c.http = hc } }

// WithCAFile trusts the CA certificates in a PEM file, for an API served
// over https (api.tls) with a certificate of a private CA; the system's
// roots are then not trusted. It replaces the transport of the client
// WithHTTPClient gives, keeping its other settings. A file that cannot be
// read makes every call fail, saying so.
func WithCAFile(file string) Option { return func(c *Client) { c.caFile = file } }

// New returns a client of the API at baseURL (such as http://hipq:8080,
// or https://hipq:8443 with api.tls).
func New(baseURL string, opts ...Option) *Client {
	c := &Client{base: strings.TrimRight(baseURL, "/"), http: http.DefaultClient}
	for _, o := range opts {
		o(c)
	}
	if c.caFile != "" {
		pool, err := readCAs(c.caFile)
		if err != nil {
			c.err = &configError{fmt.Errorf("hipq: CA file: %w", err)}
			return c
		}
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
		hc := *c.http
		hc.Transport = tr
		c.http = &hc
	}
	return c
}

// readCAs reads a file of PEM certificates.
func readCAs(file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("no PEM certificate in %s", file)
	}
	return pool, nil
}

// configError is a mistake in the client's options: no call can pass.
type configError struct{ err error }

func (e *configError) Error() string { return e.err.Error() }
func (e *configError) Unwrap() error { return e.err }

// Job is a job to enqueue: Type and Key are required; the rest default
// from the job type's configuration, as for a Kafka intake record.
type Job struct {
	Type             string          `json:"-"`
	Key              string          `json:"-"`
	Data             json.RawMessage `json:"job_data,omitempty"`
	ScheduledRunTime *time.Time      `json:"scheduled_run_time,omitempty"`
	Priority         *int            `json:"priority,omitempty"`
	TimeoutSeconds   *int            `json:"timeout_seconds,omitempty"`
	ThrottleFactor   *int            `json:"throttle_factor,omitempty"`
	TimeWindows      []TimeWindow    `json:"time_windows,omitempty"`
	ExpiresAt        *time.Time      `json:"expires_at,omitempty"`
}

// IntakeJSON is the job as an intake message: the JSON value of a Kafka
// intake record or of an outbox row (hipq_intake.value), with job_type and
// job_key. Fields left empty take the job type's defaults in hipq.
func (j Job) IntakeJSON() ([]byte, error) {
	type body Job // the same fields, without this method
	type msg struct {
		Type string `json:"job_type"`
		Key  string `json:"job_key"`
		body
	}
	return json.Marshal(msg{Type: j.Type, Key: j.Key, body: body(j)})
}

// TimeWindow is a daily window in which a job may start.
type TimeWindow struct {
	Start string `json:"start"` // HH:MM
	End   string `json:"end"`   // HH:MM
	TZ    string `json:"tz,omitempty"`
}

// JobRow is a job as hipq stores it (the columns of hipq_job).
type JobRow struct {
	ID               int64           `json:"id"`
	Queue            string          `json:"queue"`
	Type             string          `json:"job_type"`
	Key              string          `json:"job_key"`
	Data             json.RawMessage `json:"job_data"`
	State            string          `json:"state"`   // initial, running, retry, final
	Outcome          *string         `json:"outcome"` // once final: succeeded, failed, timed_out, expired, cancelled
	Error            string          `json:"error"`
	Attempt          int             `json:"attempt"`
	MaxAttempts      int             `json:"max_attempts"`
	ScheduledRunTime time.Time       `json:"scheduled_run_time"`
	Priority         int             `json:"priority"`
	ThrottleFactor   int             `json:"throttle_factor"`
	TimeWindows      []TimeWindow    `json:"time_windows"`
	TimeoutSeconds   int             `json:"timeout_seconds"`
	ExpiresAt        *time.Time      `json:"expires_at"`
	StartedAt        *time.Time      `json:"started_at"`
	Result           json.RawMessage `json:"result"`
	CreatedAt        time.Time       `json:"created_at"`
	UpdateTime       time.Time       `json:"update_time"`
}

// Final reports whether the job will never change again.
func (j *JobRow) Final() bool { return j.State == "final" }

// Ref names this very job: its type, key and id (a key is reused once its
// job is final).
func (j *JobRow) Ref() Ref { return Ref{Type: j.Type, Key: j.Key, ID: j.ID} }

// Ref names one job.
type Ref struct {
	Type, Key string
	ID        int64
}

// Attempt is one attempt of a job (a row of hipq_attempt).
type Attempt struct {
	Attempt      int             `json:"attempt"`
	Instance     string          `json:"instance"`
	DispatchedAt time.Time       `json:"dispatched_at"`
	SentAt       *time.Time      `json:"sent_at"`
	RepliedAt    *time.Time      `json:"replied_at"`
	Outcome      *string         `json:"outcome"`
	Error        *string         `json:"error"`
	Reply        json.RawMessage `json:"reply"`
}

// Error is an answer of the API other than success.
type Error struct {
	Status  int    // the HTTP status
	Code    string // such as conflict, unauthorized, invalid_field, not_found
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("hipq: %d %s: %s", e.Status, e.Code, e.Message) }

// Is lets errors.Is match the sentinels below by status.
func (e *Error) Is(target error) bool {
	switch target {
	case ErrConflict:
		return e.Status == http.StatusConflict
	case ErrUnauthorized:
		return e.Status == http.StatusUnauthorized
	case ErrNotFound:
		return e.Status == http.StatusNotFound
	case ErrInvalid:
		return e.Status == http.StatusBadRequest || e.Status == http.StatusRequestEntityTooLarge
	}
	return false
}

// Field is the field an invalid request names, when it names one
// ("job_key: 20480 bytes is more than the limit of 1024" → job_key).
func (e *Error) Field() string {
	if f, _, ok := strings.Cut(e.Message, ": "); ok && !strings.ContainsAny(f, " \"") {
		return f
	}
	return ""
}

// Sentinels for errors.Is.
var (
	// ErrConflict: a non-final job of the key has other data (Enqueue), or
	// the job is not final (Replay) or already final (Cancel).
	ErrConflict = errors.New("conflict")
	// ErrUnauthorized: no valid token.
	ErrUnauthorized = errors.New("unauthorized")
	// ErrNotFound: no such job, or an unknown job type.
	ErrNotFound = errors.New("not found")
	// ErrInvalid: the request was refused as invalid; Error.Field names the field.
	ErrInvalid = errors.New("invalid request")
)

// Enqueue creates the job unless a non-final job of its type and key
// exists: created is false when that job has the same data (it is
// returned); other data is an error matching ErrConflict.
func (c *Client) Enqueue(ctx context.Context, j Job) (row JobRow, created bool, err error) {
	body, err := json.Marshal(j)
	if err != nil {
		return JobRow{}, false, err
	}
	var out struct{ Job JobRow }
	status, err := c.call(ctx, http.MethodPut, c.jobPath(j.Type, j.Key, ""), nil, body, &out)
	return out.Job, status == http.StatusCreated, err
}

// Get returns the non-final job of the type and key, else its latest final
// one, with its attempts.
func (c *Client) Get(ctx context.Context, jobType, jobKey string) (JobRow, []Attempt, error) {
	var out struct {
		Job      JobRow
		Attempts []Attempt
	}
	_, err := c.call(ctx, http.MethodGet, c.jobPath(jobType, jobKey, ""), nil, nil, &out)
	return out.Job, out.Attempts, err
}

// Cancel ends the non-final job of the type and key: final / cancelled.
func (c *Client) Cancel(ctx context.Context, jobType, jobKey string) (JobRow, error) {
	var out struct{ Job JobRow }
	_, err := c.call(ctx, http.MethodPost, c.jobPath(jobType, jobKey, "/cancel"), nil, nil, &out)
	return out.Job, err
}

// Replay makes a new job of a final one's type, key and data.
func (c *Client) Replay(ctx context.Context, jobType, jobKey string) (JobRow, error) {
	var out struct{ Job JobRow }
	_, err := c.call(ctx, http.MethodPost, c.jobPath(jobType, jobKey, "/replay"), nil, nil, &out)
	return out.Job, err
}

// ListOptions filter List; empty fields match everything.
type ListOptions struct {
	Type, State, Queue string
	PageSize           int // 1 to 1000; defaults to 100
}

// List yields jobs newest first, page after page, until there are no more,
// an error (yielded last), or the loop stops.
func (c *Client) List(ctx context.Context, o ListOptions) iter.Seq2[JobRow, error] {
	return func(yield func(JobRow, error) bool) {
		q := url.Values{}
		for k, v := range map[string]string{"job_type": o.Type, "state": o.State, "queue": o.Queue} {
			if v != "" {
				q.Set(k, v)
			}
		}
		if o.PageSize > 0 {
			q.Set("limit", strconv.Itoa(o.PageSize))
		}
		for {
			var page struct {
				Jobs       []JobRow
				NextCursor string `json:"next_cursor"` // opaque
			}
			if _, err := c.call(ctx, http.MethodGet, "/v1/jobs", q, nil, &page); err != nil {
				yield(JobRow{}, err)
				return
			}
			for _, j := range page.Jobs {
				if !yield(j, nil) {
					return
				}
			}
			if page.NextCursor == "" {
				return
			}
			q.Set("cursor", page.NextCursor)
		}
	}
}

// Wait returns the job once it is final. It long-polls the API (the
// server answers when the job ends, or after a while with the job as it
// is, and Wait asks again), so it never polls in a loop of its own. It
// rides out a restart or outage of hipq: a failed connection, a 5xx, 408
// or 429 is tried again after a pause of at most a second, until ctx ends;
// only an answer that will not change (such as 404 or 401) ends it early.
func (c *Client) Wait(ctx context.Context, ref Ref) (JobRow, error) {
	q := url.Values{"job_id": {strconv.FormatInt(ref.ID, 10)}, "wait": {"30s"}}
	pause := 50 * time.Millisecond
	for {
		var out struct{ Job JobRow }
		_, err := c.call(ctx, http.MethodGet, c.jobPath(ref.Type, ref.Key, ""), q, nil, &out)
		switch {
		case err == nil && out.Job.Final():
			return out.Job, nil
		case ctx.Err() != nil:
			return out.Job, ctx.Err()
		case err == nil:
			pause = 50 * time.Millisecond // the wait ran out: ask again at once
			continue
		case !transient(err):
			return JobRow{}, err
		}
		select {
		case <-ctx.Done():
			return JobRow{}, ctx.Err()
		case <-time.After(pause):
		}
		pause = min(2*pause, time.Second)
	}
}

// transient reports whether an error may go away by itself: anything but
// an answer of the API that says the request itself is wrong.
func transient(err error) bool {
	var (
		ce         *configError
		unverified *tls.CertificateVerificationError
	)
	if errors.As(err, &ce) || errors.As(err, &unverified) {
		return false // the client's options, or a server certificate it does not trust
	}
	var e *Error
	if !errors.As(err, &e) {
		return true // no answer: connection refused or reset, a timeout
	}
	return e.Status >= 500 || e.Status == http.StatusRequestTimeout || e.Status == http.StatusTooManyRequests
}

func (c *Client) jobPath(jobType, jobKey, suffix string) string {
	return "/v1/jobs/" + url.PathEscape(jobType) + "/" + url.PathEscape(jobKey) + suffix
}

// call makes one API call and decodes its JSON answer into out.
func (c *Client) call(ctx context.Context, method, path string, q url.Values, body []byte, out any) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	u := c.base + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return 0, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return resp.StatusCode, err
	}
	if resp.StatusCode >= 300 {
		var e struct {
			Error struct{ Code, Message string }
		}
		_ = json.Unmarshal(raw, &e)
		if e.Error.Code == "" {
			e.Error.Code, e.Error.Message = "http", strings.TrimSpace(string(raw))
		}
		return resp.StatusCode, &Error{Status: resp.StatusCode, Code: e.Error.Code, Message: e.Error.Message}
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			return resp.StatusCode, fmt.Errorf("hipq: answer of %s %s: %w", method, path, err)
		}
	}
	return resp.StatusCode, nil
}

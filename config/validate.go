package config

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/hipq/hipq/api"
	"github.com/hipq/hipq/consumer"
	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/memlimit"
	"github.com/hipq/hipq/internal/tlsconf"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/schemas"
	"github.com/hipq/hipq/store"
	"github.com/hipq/hipq/sweeper"
)

// DefaultQueue exists without being declared.
const DefaultQueue = correlator.DefaultQueue

// Defaults owned by the config itself; every other default is the
// constant of the package that owns the setting.
const (
	DefaultName            = "hipq"
	DefaultShutdownTimeout = 15 * time.Second
	DefaultCompression     = "none"
	DefaultIsolationLevel  = "read_committed"
	DefaultLogLevel        = "info"
	DefaultLogFormat       = "json"
	DefaultBackoff         = "exponential"
	// DefaultMetricsListen is where an instance without the API serves
	// /metrics, /healthz and /readyz: the port OpenTelemetry's Prometheus
	// exporters use.
	DefaultMetricsListen = ":9464"
)

// Record sizes (intake.max_bytes, kafka.max_record_bytes).
const (
	// DefaultMaxRecordBytes is the producer's default largest record.
	DefaultMaxRecordBytes = 1000012
	// RecordOverhead is what a request record holds besides the job's
	// data, at most: the key (job_key, up to 1 KiB), the hipq-* headers
	// and the envelope (job_key and job_type again, the reply topic) and
	// Kafka's own framing.
	RecordOverhead = 8 << 10
	// DefaultMaxBytes leaves that room under DefaultMaxRecordBytes.
	DefaultMaxBytes = 960 << 10
)

func (c *Config) fillDefaults() {
	def := func(s *string, v string) { *s = cmp.Or(*s, v) }
	defD := func(d *Duration, v time.Duration) { *d = cmp.Or(*d, Duration(v)) }
	yes := func(b **bool) {
		if *b == nil {
			t := true
			*b = &t
		}
	}
	def(&c.Name, DefaultName)
	def(&c.Database.Schema, store.DefaultSchema)
	c.Database.MaxConns = cmp.Or(c.Database.MaxConns, store.DefaultMaxConns)
	yes(&c.Database.Migrate)
	def(&c.Database.Citus, store.CitusAuto)
	def(&c.Kafka.ClientID, c.Name)
	defD(&c.Kafka.SessionTimeout, consumer.DefaultSessionTimeout)
	def(&c.Kafka.IsolationLevel, DefaultIsolationLevel)
	def(&c.Kafka.Compression, DefaultCompression)
	def(&c.Intake.Group, c.Name+"-intake")
	c.Intake.Start = cmp.Or(c.Intake.Start, consumer.DefaultStart)
	yes(&c.Intake.Outbox)
	c.Intake.MaxBytes = cmp.Or(c.Intake.MaxBytes, DefaultMaxBytes)
	c.Kafka.MaxRecordBytes = cmp.Or(c.Kafka.MaxRecordBytes, DefaultMaxRecordBytes)
	def(&c.Responses.Group, c.Name+"-responses")
	c.Responses.Start = cmp.Or(c.Responses.Start, consumer.DefaultStart)
	defD(&c.Responses.EarlyTTL, consumer.DefaultEarlyTTL)
	defD(&c.Dispatch.Interval, dispatcher.DefaultInterval)
	c.Dispatch.BatchSize = cmp.Or(c.Dispatch.BatchSize, dispatcher.DefaultBatchSize)
	defD(&c.Dispatch.Grace, sweeper.DefaultGrace)
	def(&c.Sweeper.Schedule, sweeper.DefaultSchedule)
	defD(&c.Sweeper.Retention, sweeper.DefaultRetention)
	defD(&c.Sweeper.DeadLetterRetention, sweeper.DefaultDeadLetterRetention)
	if c.API != nil {
		def(&c.API.Listen, api.DefaultListen)
		scheme := "http://"
		if c.API.TLS != nil {
			scheme = "https://"
		}
		def(&c.API.PublicURL, scheme+c.API.Listen)
		c.API.MaxConns = cmp.Or(c.API.MaxConns, api.DefaultMaxConns)
		defD(&c.API.RequestTimeout, api.DefaultRequestTimeout)
		defD(&c.API.UI.SessionTTL, api.DefaultSessionTTL)
	}
	if c.API == nil {
		def(&c.Metrics.Listen, DefaultMetricsListen)
	}
	defD(&c.ShutdownTimeout, DefaultShutdownTimeout)
	def(&c.Log.Level, DefaultLogLevel)
	def(&c.Log.Format, DefaultLogFormat)
	if !slices.ContainsFunc(c.Queues, func(q Queue) bool { return q.Name == DefaultQueue }) {
		c.Queues = append(c.Queues, Queue{Name: DefaultQueue})
	}
	for i := range c.Queues {
		c.Queues[i].Order = cmp.Or(c.Queues[i].Order, correlator.OrderScheduledFirst)
	}
	if c.Events.Topic != "" && c.Events.On == nil {
		c.Events.On = []string{correlator.EventsOnFinal}
	}
	for i := range c.JobTypes {
		jt := &c.JobTypes[i]
		def(&jt.Queue, DefaultQueue)
		if e := jt.Events; e != nil {
			def(&e.Topic, c.Events.Topic)
			if e.On == nil {
				e.On = c.Events.On
				if e.On == nil {
					e.On = []string{correlator.EventsOnFinal}
				}
			}
		} else if c.Events.Topic != "" {
			jt.Events = &JobEvents{Topic: c.Events.Topic, On: c.Events.On}
		}
		defD(&jt.Timeout, correlator.DefaultJobTimeout)
		if jt.Priority == nil {
			p := correlator.DefaultPriority
			jt.Priority = &p
		}
		jt.ThrottleFactor = cmp.Or(jt.ThrottleFactor, correlator.DefaultThrottleFactor)
		jt.Delivery = cmp.Or(jt.Delivery, correlator.DefaultDelivery)
		if h := jt.Transport.HTTP; h != nil {
			def(&h.Method, dispatcher.DefaultHTTPMethod)
			h.Mode = cmp.Or(h.Mode, dispatcher.HTTPAsync)
			h.timeoutDefaulted = h.Timeout == 0
			defD(&h.Timeout, dispatcher.DefaultHTTPTimeout)
			h.MaxInFlight = cmp.Or(h.MaxInFlight, dispatcher.DefaultHTTPMaxInFlight)
		}
		if r := jt.Retry; r != nil {
			r.MaxAttempts = cmp.Or(r.MaxAttempts, correlator.DefaultRetryAttempts)
			def(&r.Backoff, DefaultBackoff)
			defD(&r.Initial, correlator.DefaultRetryInitial)
			r.Multiplier = cmp.Or(r.Multiplier, correlator.DefaultRetryMultiplier)
			defD(&r.Max, correlator.DefaultRetryMax)
			if r.Jitter == nil {
				j := correlator.DefaultRetryJitter
				r.Jitter = &j
			}
			if r.When == nil {
				for _, o := range correlator.DefaultRetryWhen(jt.Delivery) {
					r.When = append(r.When, string(o))
				}
			}
		}
	}
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// Validate returns every problem at once, as Errors, or nil.
func (c *Config) Validate() error {
	var errs Errors
	bad := func(path, format string, args ...any) {
		errs = append(errs, Problem{Path: path, Reason: fmt.Sprintf(format, args...)})
	}
	oneOf := func(path, v string, allowed ...string) {
		if !slices.Contains(allowed, v) {
			bad(path, "%q is not one of %v", v, allowed)
		}
	}
	positive := func(path string, d Duration) {
		if d <= 0 {
			bad(path, "must be a positive duration")
		}
	}
	if !nameRE.MatchString(c.Name) {
		bad("name", "%q must be letters, digits, '.', '_' or '-'", c.Name)
	}
	if c.Database.URL == "" {
		bad("database.url", "is required")
	}
	if c.Database.MaxConns < 1 {
		bad("database.max_conns", "must be at least 1")
	}
	oneOf("database.citus", c.Database.Citus, store.CitusAuto, store.CitusOn, store.CitusOff)
	if len(c.Kafka.Brokers) == 0 {
		bad("kafka.brokers", "at least one broker is required")
	}
	positive("kafka.session_timeout", c.Kafka.SessionTimeout)
	oneOf("kafka.isolation_level", c.Kafka.IsolationLevel, DefaultIsolationLevel, "read_uncommitted")
	oneOf("kafka.compression", c.Kafka.Compression, kafkaconn.Compressions...)
	oneOf("kafka.sasl.mechanism", c.Kafka.SASL.Mechanism, "", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
	if c.Kafka.SASL.Mechanism != "" && c.Kafka.SASL.Username == "" {
		bad("kafka.sasl.username", "is required with a SASL mechanism")
	}
	if kt := c.Kafka.TLS; !kt.Enabled && (kt.CAFile != "" || kt.CertFile != "" || kt.KeyFile != "" || kt.ServerName != "") {
		bad("kafka.tls.enabled", "ca_file, server_name, cert_file or key_file is set but TLS is not enabled")
	} else if kt.Enabled {
		c.checkTLSFiles("kafka.tls", tlsconf.Files{CAFile: kt.CAFile, CertFile: kt.CertFile, KeyFile: kt.KeyFile}, false, bad)
	}
	for i, t := range c.Intake.Topics {
		if t == "" {
			bad(fmt.Sprintf("intake.topics[%d]", i), "must not be empty")
		}
	}
	oneOf("intake.start", string(c.Intake.Start), string(consumer.StartEarliest), string(consumer.StartLatest))
	if c.Intake.MaxBytes < 1 {
		bad("intake.max_bytes", "must be positive")
	}
	if c.Kafka.MaxRecordBytes < RecordOverhead+1024 {
		bad("kafka.max_record_bytes", "%d is too small for a request record (at least %d)", c.Kafka.MaxRecordBytes, RecordOverhead+1024)
	}
	for i, jt := range c.JobTypes {
		// A job every request of which would be refused as too large must
		// be refused at intake, not burn its attempts.
		if jt.Transport.Kafka != nil && c.Intake.MaxBytes+RecordOverhead > c.Kafka.MaxRecordBytes {
			bad("intake.max_bytes", "%d plus %d bytes of key, headers and envelope does not fit in kafka.max_record_bytes (%d), "+
				"so a job that large could never be sent to job_types[%d]'s topic: lower intake.max_bytes to %d or raise kafka.max_record_bytes",
				c.Intake.MaxBytes, RecordOverhead, c.Kafka.MaxRecordBytes, i, c.Kafka.MaxRecordBytes-RecordOverhead)
			break
		}
	}
	oneOf("responses.start", string(c.Responses.Start), string(consumer.StartEarliest), string(consumer.StartLatest))
	positive("responses.early_ttl", c.Responses.EarlyTTL)
	if c.Intake.Group == c.Responses.Group {
		bad("responses.group", "must differ from intake.group (%q)", c.Intake.Group)
	}
	replyTopics := map[string]bool{}
	for i, rt := range c.Responses.Topics {
		p := fmt.Sprintf("responses.topics[%d]", i)
		if rt.Topic == "" {
			bad(p+".topic", "is required")
		}
		if replyTopics[rt.Topic] {
			bad(p+".topic", "%q is listed twice", rt.Topic)
		}
		replyTopics[rt.Topic] = true
		for name, f := range map[string]*correlator.Field{"job_id": rt.JobID, "job_type": rt.JobType, "job_key": rt.JobKey,
			"attempt": rt.Attempt, "retryable": rt.Retryable, "error": rt.Error, "result": rt.Result, "retry_after": rt.RetryAfter} {
			if f != nil {
				if err := f.Validate(); err != nil {
					bad(p+"."+name, "%v", err)
				}
			}
		}
		if rt.Status != nil {
			if err := rt.Status.Field.Validate(); err != nil {
				bad(p+".status", "%v", err)
			}
		}
	}
	positive("dispatch.interval", c.Dispatch.Interval)
	if c.Dispatch.BatchSize < 1 || c.Dispatch.BatchSize > 10000 {
		bad("dispatch.batch_size", "must be between 1 and 10000")
	}
	if c.Dispatch.Grace < 0 {
		bad("dispatch.grace", "must not be negative")
	}
	if _, err := cron.ParseStandard(c.Sweeper.Schedule); err != nil {
		bad("sweeper.schedule", "%v", err)
	}
	positive("sweeper.retention", c.Sweeper.Retention)
	positive("sweeper.dead_letter_retention", c.Sweeper.DeadLetterRetention)
	if a := c.API; a != nil {
		if a.TLS != nil {
			c.checkTLSFiles("api.tls", tlsconf.Files{CertFile: a.TLS.CertFile, KeyFile: a.TLS.KeyFile}, true, bad)
		}
		if len(a.CallbackSecret) < 32 {
			bad("api.callback_secret", "is required and must be at least 32 bytes")
		}
		for i, t := range a.Tokens {
			if len(t) < 32 {
				bad(fmt.Sprintf("api.tokens[%d]", i), "must be at least 32 bytes")
			}
		}
		for i, t := range a.ReadTokens {
			if len(t) < 32 {
				bad(fmt.Sprintf("api.read_tokens[%d]", i), "must be at least 32 bytes")
			}
		}
		if len(a.ReadTokens) > 0 && len(a.Tokens) == 0 {
			bad("api.read_tokens", "needs api.tokens too: without admin tokens the API needs no token at all")
		}
		if p := a.UI.PathPrefix; p != "" && (!strings.HasPrefix(p, "/") || strings.HasSuffix(p, "/") ||
			strings.ContainsAny(p, "?#%{} \"") || strings.Contains(p, "//")) {
			bad("api.ui.path_prefix", "%q must start with / and not end with one, like /hipq (no ?, #, %%, braces, quotes or spaces)", p)
		}
		if a.UI.SessionTTL < Duration(time.Minute) {
			bad("api.ui.session_ttl", "%v must be at least 1m", a.UI.SessionTTL.D())
		}
		for i, ptr := range a.UI.Redact {
			if !strings.HasPrefix(ptr, "/") {
				bad(fmt.Sprintf("api.ui.redact[%d]", i), "%q is not a JSON pointer to a field, like /card/number", ptr)
			}
		}
		if u, err := url.Parse(a.PublicURL); err != nil || u.Scheme == "" || u.Host == "" {
			bad("api.public_url", "%q is not an absolute URL", a.PublicURL)
		}
		if a.MaxConns < 1 {
			bad("api.max_conns", "%d must be at least 1", a.MaxConns)
		}
		positive("api.request_timeout", a.RequestTimeout)
	}
	if l := c.Metrics.Listen; l != "" {
		if _, port, err := net.SplitHostPort(l); err != nil {
			bad("metrics.listen", "%q is not host:port, like :9464 or 127.0.0.1:9464", l)
		} else if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
			bad("metrics.listen", "%q: the port %q is not a number from 0 to 65535", l, port)
		}
	}
	positive("shutdown_timeout", c.ShutdownTimeout)
	if c.MemoryLimit != 0 && c.MemoryLimit < memlimit.Min {
		bad("memory_limit", "%s is below the minimum of %s (the binary's resident pages and the heap at rest nearly fill that)",
			memlimit.Format(int64(c.MemoryLimit)), memlimit.Format(memlimit.Min))
	}
	if s := c.Tracing.Sampler; s != "" && s != tracing.SamplerParentRatio && !slices.Contains(tracing.Samplers, s) {
		bad("tracing.sampler", "%q is not one of OpenTelemetry's %s", s, strings.Join(tracing.Samplers, ", "))
	}
	if c.Tracing.Ratio < 0 || c.Tracing.Ratio > 1 {
		bad("tracing.ratio", "%v must be between 0 and 1", c.Tracing.Ratio)
	} else if s := c.Tracing.Sampler; c.Tracing.Ratio != 0 && s != "" && !tracing.TakesRatio(s) {
		bad("tracing.ratio", "sampler %s takes no ratio (only traceidratio and parentbased_traceidratio do)", s)
	}
	if e := c.Tracing.Endpoint; e != "" {
		if u, err := url.Parse(e); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("tracing.endpoint", "%q is not an http(s) URL", e)
		}
	}
	oneOf("log.level", c.Log.Level, "debug", "info", "warn", "error")
	oneOf("log.format", c.Log.Format, "json", "console")
	queues := map[string]*Queue{}
	for i := range c.Queues {
		q := &c.Queues[i]
		p := fmt.Sprintf("queues[%d]", i)
		if !nameRE.MatchString(q.Name) {
			bad(p+".name", "%q must be letters, digits, '.', '_' or '-'", q.Name)
		}
		if queues[q.Name] != nil {
			bad(p+".name", "queue %q is declared twice", q.Name)
		}
		queues[q.Name] = q
		oneOf(p+".order", string(q.Order), string(correlator.OrderScheduledFirst), string(correlator.OrderPriorityFirst))
		if q.ThrottleLimit < 0 {
			bad(p+".throttle_limit", "must not be negative")
		}
		for k, r := range q.Rates {
			if _, err := r.rate("", ""); err != nil {
				bad(fmt.Sprintf("%s.rates[%d]", p, k), "%v", err)
			}
		}
		if s := q.Shares; s != nil {
			if q.ThrottleLimit < 1 {
				bad(p+".shares", "need throttle_limit >= 1")
			}
			if err := s.By.Validate(); err != nil || s.By.JSON == "" {
				bad(p+".shares.by", "must be {json: /pointer} into job_data")
			}
			if len(s.Weights) == 0 {
				bad(p+".shares.weights", "at least one weight is required")
			}
			for k, w := range s.Weights {
				if w < 1 {
					bad(p+".shares.weights."+k, "must be a positive integer")
				}
			}
		}
	}
	types := map[string]bool{}
	for i := range c.JobTypes {
		jt := &c.JobTypes[i]
		p := fmt.Sprintf("job_types[%d]", i)
		if !nameRE.MatchString(jt.Name) {
			bad(p+".name", "%q must be letters, digits, '.', '_' or '-'", jt.Name)
		}
		if types[jt.Name] {
			bad(p+".name", "job type %q is declared twice", jt.Name)
		}
		types[jt.Name] = true
		q := queues[jt.Queue]
		if q == nil {
			bad(p+".queue", "queue %q is not declared in queues", jt.Queue)
		}
		tr := jt.Transport
		if tr.Kafka != nil && tr.Kafka.Compression != "" {
			oneOf(p+".transport.kafka.compression", tr.Kafka.Compression, kafkaconn.Compressions...)
		}
		switch {
		case (tr.Kafka == nil) == (tr.HTTP == nil):
			bad(p+".transport", "name exactly one of kafka or http")
		case tr.Kafka != nil && tr.Kafka.Topic == "":
			bad(p+".transport.kafka.topic", "is required")
		case tr.HTTP != nil:
			h := tr.HTTP
			if u, err := url.Parse(h.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				bad(p+".transport.http.url", "%q is not an http(s) URL", h.URL)
			}
			if t := h.TLS; t != nil {
				if u, err := url.Parse(h.URL); err == nil && u.Scheme == "http" {
					bad(p+".transport.http.tls", "is set but the url %q is not https", h.URL)
				}
				if *t == (HTTPTLS{}) {
					bad(p+".transport.http.tls", "is empty: set ca_file, or cert_file and key_file")
				}
				c.checkTLSFiles(p+".transport.http.tls", tlsconf.Files{CAFile: t.CAFile, CertFile: t.CertFile, KeyFile: t.KeyFile}, false, bad)
			}
			oneOf(p+".transport.http.mode", string(h.Mode), string(dispatcher.HTTPAsync), string(dispatcher.HTTPSync))
			positive(p+".transport.http.timeout", h.Timeout)
			if h.MaxInFlight < 1 {
				bad(p+".transport.http.max_in_flight", "%d must be at least 1", h.MaxInFlight)
			}
			if h.Timeout >= jt.Timeout {
				if h.timeoutDefaulted {
					bad(p+".transport.http.timeout", "the default of %v must be shorter than the type's timeout %v: set transport.http.timeout below %v",
						h.Timeout.D(), jt.Timeout.D(), jt.Timeout.D())
				} else {
					bad(p+".transport.http.timeout", "%v must be shorter than the type's timeout %v", h.Timeout.D(), jt.Timeout.D())
				}
			}
			if h.Mode == dispatcher.HTTPAsync && c.API == nil {
				bad(p+".transport.http.mode", "async HTTP needs the api section for callbacks")
			}
		}
		if jt.ReplyTopic != "" && !replyTopics[jt.ReplyTopic] {
			bad(p+".reply_topic", "%q is not one of responses.topics", jt.ReplyTopic)
		}
		if jt.Timeout < Duration(time.Second) {
			bad(p+".timeout", "must be at least 1s")
		}
		if jt.HeartbeatTimeout < 0 {
			bad(p+".heartbeat_timeout", "must not be negative")
		}
		if jt.MaxTimeout != 0 && jt.MaxTimeout < jt.Timeout {
			bad(p+".max_timeout", "%v must be at least the timeout %v", jt.MaxTimeout.D(), jt.Timeout.D())
		}
		if jt.HeartbeatTimeout > 0 && jt.MaxTimeout == 0 {
			bad(p+".max_timeout", "is required with heartbeat_timeout: without it news extends nothing (max_timeout defaults to timeout)")
		}
		if jt.ThrottleFactor < 1 {
			bad(p+".throttle_factor", "must be at least 1")
		} else if q != nil && !jt.Critical && q.ThrottleLimit > 0 && jt.ThrottleFactor > q.ThrottleLimit {
			bad(p+".throttle_factor", "%d is larger than queue %q's throttle_limit %d", jt.ThrottleFactor, q.Name, q.ThrottleLimit)
		}
		if jt.MaxConcurrency < 0 {
			bad(p+".max_concurrency", "must not be negative")
		}
		oneOf(p+".delivery", string(jt.Delivery), string(correlator.AtLeastOnce), string(correlator.AtMostOnce))
		if r := jt.Retry; r != nil {
			if r.MaxAttempts < 1 {
				bad(p+".retry.max_attempts", "must be at least 1")
			}
			oneOf(p+".retry.backoff", r.Backoff, "fixed", DefaultBackoff)
			if r.Initial < 0 {
				bad(p+".retry.initial", "must not be negative")
			}
			if r.Multiplier < 1 {
				bad(p+".retry.multiplier", "must be at least 1")
			}
			if r.Max < r.Initial {
				bad(p+".retry.max", "must be at least retry.initial")
			}
			if *r.Jitter < 0 || *r.Jitter > 1 {
				bad(p+".retry.jitter", "must be between 0 and 1")
			}
			for k, w := range r.When {
				o, err := correlator.ParseAttemptOutcome(w)
				if err != nil {
					bad(fmt.Sprintf("%s.retry.when[%d]", p, k), "%v", err)
				} else if o == correlator.AttemptTimedOut && jt.Delivery == correlator.AtMostOnce {
					bad(fmt.Sprintf("%s.retry.when[%d]", p, k), "at_most_once types may not retry timed_out: the request may have arrived")
				}
			}
		}
		if jt.DataSchema != "" {
			ds, err := schemas.CompileDataSchema(c.Path(jt.DataSchema))
			if err != nil {
				bad(p+".data_schema", "%v", err)
			}
			jt.dataSchema = ds
		}
		for k, r := range jt.Rates {
			if _, err := r.rate("", jt.Name); err != nil {
				bad(fmt.Sprintf("%s.rates[%d]", p, k), "%v", err)
			}
		}
		for k := range jt.TimeWindows {
			if err := jt.TimeWindows[k].Compile(); err != nil {
				bad(fmt.Sprintf("%s.time_windows[%d]", p, k), "%v", err)
			}
		}
	}
	c.validateEvents(bad, replyTopics)
	names := map[string]bool{}
	for i := range c.Schedules {
		sc := &c.Schedules[i]
		p := fmt.Sprintf("schedules[%d]", i)
		if !nameRE.MatchString(sc.Name) {
			bad(p+".name", "%q must be letters, digits, '.', '_' or '-'", sc.Name)
		}
		if names[sc.Name] {
			bad(p+".name", "schedule %q is declared twice", sc.Name)
		}
		names[sc.Name] = true
		if !types[sc.JobType] {
			bad(p+".job_type", "%q is not one of job_types", sc.JobType)
		}
		s, err := sc.schedule()
		if err != nil {
			bad(p+"."+err.Field, "%s", err.Reason)
			continue
		}
		sc.compiled = s
	}
	if len(errs) == 0 {
		// Each schedule's job must pass what intake asks of it (data_schema).
		domain := c.Domain()
		for i, sc := range c.Schedules {
			req, _ := sc.compiled.Request(time.Now())
			if _, err := correlator.NewJob(req, domain.Get(sc.JobType), time.Now()); err != nil {
				bad(fmt.Sprintf("schedules[%d].job_data", i), "%v", err)
			}
		}
	}
	if len(errs) > 0 {
		return errs
	}
	return nil
}

// Path is a file path of the config as hipq opens it: a relative path
// starts at the config file's folder (the working directory for Parse).
func (c *Config) Path(p string) string {
	if p == "" || filepath.IsAbs(p) || c.dir == "" {
		return p
	}
	return filepath.Join(c.dir, p)
}

// checkTLSFiles reads the files of a TLS section as hipq will (a server's
// when server), and reports what is wrong under prefix: a missing or
// unreadable file, a CA file with no certificate, a key that is not the
// certificate's.
func (c *Config) checkTLSFiles(prefix string, f tlsconf.Files, server bool, bad func(path, format string, args ...any)) {
	f.CAFile, f.CertFile, f.KeyFile = c.Path(f.CAFile), c.Path(f.CertFile), c.Path(f.KeyFile)
	var err error
	if server {
		_, err = tlsconf.Server(f)
	} else {
		_, err = tlsconf.Client(f)
	}
	var fe *tlsconf.Field
	switch {
	case errors.As(err, &fe):
		bad(prefix+"."+fe.Key, "%v", fe.Err)
	case err != nil:
		bad(prefix, "%v", err)
	}
}

// schedule compiles a schedule's definition.
func (sc *Schedule) schedule() (*correlator.Schedule, *correlator.FieldError) {
	s := &correlator.Schedule{Name: sc.Name, Cron: sc.Cron, JobType: sc.JobType, KeyTemplate: sc.JobKey,
		CatchUp: sc.CatchUp, CatchUpWindow: sc.CatchUpWindow.D(), Overlap: sc.Overlap, Zone: time.UTC}
	if sc.TZ != "" {
		loc, err := time.LoadLocation(sc.TZ)
		if err != nil {
			return nil, &correlator.FieldError{Field: "tz", Reason: fmt.Sprintf("%q is not a known time zone", sc.TZ)}
		}
		s.Zone = loc
	}
	if sc.JobData != nil {
		b, err := json.Marshal(sc.JobData)
		if err != nil {
			return nil, &correlator.FieldError{Field: "job_data", Reason: "cannot be written as JSON: " + err.Error()}
		}
		s.JobData = b
	}
	if err := s.Compile(); err != nil {
		return nil, err.(*correlator.FieldError) // Compile's errors name their field
	}
	return s, nil
}

// validateEvents checks the events sections: topics that are topic names
// and none of hipq's inputs (an event there would be read back as a job or
// a reply), known occasions, and reply_to patterns that match none of
// hipq's inputs either.
func (c *Config) validateEvents(bad func(path, format string, args ...any), replyTopics map[string]bool) {
	inputs := map[string]string{}
	for i, t := range c.Intake.Topics {
		inputs[t] = fmt.Sprintf("intake.topics[%d]", i)
	}
	for t := range replyTopics {
		inputs[t] = "responses.topics"
	}
	// The topics hipq writes other records to: a reply_to pattern may match
	// none, or a producer could put outcome events among a downstream's
	// requests or the dead letters.
	outputs := map[string]string{}
	for i, jt := range c.JobTypes {
		if k := jt.Transport.Kafka; k != nil && k.Topic != "" {
			outputs[k.Topic] = fmt.Sprintf("job_types[%d].transport.kafka.topic", i)
		}
	}
	if t := c.Intake.DeadLetterTopic; t != "" {
		outputs[t] = "intake.dead_letter_topic"
	}
	if t := c.Responses.DeadLetterTopic; t != "" {
		outputs[t] = "responses.dead_letter_topic"
	}
	topic := func(path, t string) {
		if err := correlator.ValidTopic(t); err != nil {
			bad(path, "%v", err)
		} else if in, ok := inputs[t]; ok {
			bad(path, "%q is one of hipq's inputs (%s): its events would be read back", t, in)
		}
	}
	on := func(path string, on []string) {
		for k, o := range on {
			if o != correlator.EventsOnFinal && o != correlator.EventsOnAttempt {
				bad(fmt.Sprintf("%s[%d]", path, k), "%q is not one of [%s %s]", o, correlator.EventsOnFinal, correlator.EventsOnAttempt)
			}
		}
	}
	if c.Events.Topic != "" {
		topic("events.topic", c.Events.Topic)
	}
	on("events.on", c.Events.On)
	if c.Events.Topic == "" && len(c.Events.On) > 0 {
		bad("events.on", "needs events.topic: the default occasions of a default topic")
	}
	for i, g := range c.Events.AllowedReplyTo {
		p := fmt.Sprintf("events.allowed_reply_to[%d]", i)
		if err := correlator.ValidTopicGlob(g); err != nil {
			bad(p, "%v", err)
			continue
		}
		for _, t := range slices.Sorted(maps.Keys(inputs)) {
			if correlator.TopicAllowed([]string{g}, t) {
				bad(p, "%q matches %q, one of hipq's inputs (%s): a job's outcome would be read back", g, t, inputs[t])
				break
			}
		}
		for _, t := range slices.Sorted(maps.Keys(outputs)) {
			if correlator.TopicAllowed([]string{g}, t) {
				bad(p, "%q matches %q, which hipq writes to (%s): a producer could have outcomes written among its records", g, t, outputs[t])
				break
			}
		}
	}
	for i, jt := range c.JobTypes {
		e := jt.Events
		if e == nil {
			continue
		}
		p := fmt.Sprintf("job_types[%d].events", i)
		on(p+".on", e.On)
		switch {
		case e.Topic == "" && len(e.On) > 0:
			bad(p+".topic", "is required: there is no events.topic to default to")
		case e.Topic != "":
			topic(p+".topic", e.Topic)
		}
	}
}

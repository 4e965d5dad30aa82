package config

import (
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/kafkaconn"
)

// DefaultQueue exists without being declared.
const DefaultQueue = "default"

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
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	defD := func(d *Duration, v time.Duration) {
		if *d == 0 {
			*d = Duration(v)
		}
	}
	def(&c.Name, "hipq")
	def(&c.Database.Schema, "public")
	if c.Database.MaxConns == 0 {
		c.Database.MaxConns = 10
	}
	if c.Database.Migrate == nil {
		t := true
		c.Database.Migrate = &t
	}
	def(&c.Kafka.ClientID, c.Name)
	defD(&c.Kafka.SessionTimeout, 10*time.Second)
	def(&c.Kafka.IsolationLevel, "read_committed")
	def(&c.Kafka.Compression, "none")
	def(&c.Intake.Group, c.Name+"-intake")
	def(&c.Intake.Start, "earliest")
	if c.Intake.Outbox == nil {
		t := true
		c.Intake.Outbox = &t
	}
	if c.Intake.MaxBytes == 0 {
		c.Intake.MaxBytes = DefaultMaxBytes
	}
	if c.Kafka.MaxRecordBytes == 0 {
		c.Kafka.MaxRecordBytes = DefaultMaxRecordBytes
	}
	def(&c.Responses.Group, c.Name+"-responses")
	def(&c.Responses.Start, "earliest")
	defD(&c.Responses.EarlyTTL, 10*time.Minute)
	defD(&c.Dispatch.Interval, time.Second)
	if c.Dispatch.BatchSize == 0 {
		c.Dispatch.BatchSize = 500
	}
	defD(&c.Dispatch.Grace, time.Minute)
	def(&c.Sweeper.Schedule, "@every 15s")
	defD(&c.Sweeper.Retention, 720*time.Hour)
	defD(&c.Sweeper.DeadLetterRetention, 720*time.Hour)
	if c.API != nil {
		def(&c.API.Listen, "127.0.0.1:8080")
		def(&c.API.PublicURL, "http://"+c.API.Listen)
		if c.API.MaxConns == 0 {
			c.API.MaxConns = 4
		}
		defD(&c.API.RequestTimeout, 10*time.Second)
	}
	defD(&c.ShutdownTimeout, 15*time.Second)
	def(&c.Log.Level, "info")
	def(&c.Log.Format, "json")
	if !slices.ContainsFunc(c.Queues, func(q Queue) bool { return q.Name == DefaultQueue }) {
		c.Queues = append(c.Queues, Queue{Name: DefaultQueue})
	}
	for i := range c.Queues {
		def(&c.Queues[i].Order, "scheduled_first")
	}
	for i := range c.JobTypes {
		jt := &c.JobTypes[i]
		def(&jt.Queue, DefaultQueue)
		defD(&jt.Timeout, 24*time.Hour)
		if jt.Priority == nil {
			p := 100
			jt.Priority = &p
		}
		if jt.ThrottleFactor == 0 {
			jt.ThrottleFactor = 1
		}
		def(&jt.Delivery, string(correlator.AtLeastOnce))
		if h := jt.Transport.HTTP; h != nil {
			def(&h.Method, "POST")
			def(&h.Mode, "async")
			h.timeoutDefaulted = h.Timeout == 0
			defD(&h.Timeout, 10*time.Second)
			if h.MaxInFlight == 0 {
				h.MaxInFlight = 64
			}
		}
		if r := jt.Retry; r != nil {
			if r.MaxAttempts == 0 {
				r.MaxAttempts = 5
			}
			def(&r.Backoff, "exponential")
			defD(&r.Initial, 10*time.Second)
			if r.Multiplier == 0 {
				r.Multiplier = 2
			}
			defD(&r.Max, time.Hour)
			if r.Jitter == nil {
				j := 0.1
				r.Jitter = &j
			}
			if r.When == nil {
				r.When = []string{"failed", "timed_out", "dispatch_error"}
				if jt.Delivery == string(correlator.AtMostOnce) {
					r.When = []string{"failed", "dispatch_error"}
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
	if len(c.Kafka.Brokers) == 0 {
		bad("kafka.brokers", "at least one broker is required")
	}
	positive("kafka.session_timeout", c.Kafka.SessionTimeout)
	oneOf("kafka.isolation_level", c.Kafka.IsolationLevel, "read_committed", "read_uncommitted")
	oneOf("kafka.compression", c.Kafka.Compression, kafkaconn.Compressions...)
	oneOf("kafka.sasl.mechanism", c.Kafka.SASL.Mechanism, "", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
	if c.Kafka.SASL.Mechanism != "" && c.Kafka.SASL.Username == "" {
		bad("kafka.sasl.username", "is required with a SASL mechanism")
	}
	if !c.Kafka.TLS.Enabled && (c.Kafka.TLS.CAFile != "" || c.Kafka.TLS.CertFile != "") {
		bad("kafka.tls.enabled", "files are set but TLS is not enabled")
	}
	if (c.Kafka.TLS.CertFile == "") != (c.Kafka.TLS.KeyFile == "") {
		bad("kafka.tls", "cert_file and key_file go together")
	}
	for i, t := range c.Intake.Topics {
		if t == "" {
			bad(fmt.Sprintf("intake.topics[%d]", i), "must not be empty")
		}
	}
	oneOf("intake.start", c.Intake.Start, "earliest", "latest")
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
	oneOf("responses.start", c.Responses.Start, "earliest", "latest")
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
			"attempt": rt.Attempt, "retryable": rt.Retryable, "error": rt.Error, "result": rt.Result} {
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
		if len(a.CallbackSecret) < 32 {
			bad("api.callback_secret", "is required and must be at least 32 bytes")
		}
		for i, t := range a.Tokens {
			if len(t) < 32 {
				bad(fmt.Sprintf("api.tokens[%d]", i), "must be at least 32 bytes")
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
	positive("shutdown_timeout", c.ShutdownTimeout)
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
		oneOf(p+".order", q.Order, "scheduled_first", "priority_first")
		if q.ThrottleLimit < 0 {
			bad(p+".throttle_limit", "must not be negative")
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
			oneOf(p+".transport.http.mode", h.Mode, "async", "sync")
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
			if h.Mode == "async" && c.API == nil {
				bad(p+".transport.http.mode", "async HTTP needs the api section for callbacks")
			}
		}
		if jt.ReplyTopic != "" && !replyTopics[jt.ReplyTopic] {
			bad(p+".reply_topic", "%q is not one of responses.topics", jt.ReplyTopic)
		}
		if jt.Timeout < Duration(time.Second) {
			bad(p+".timeout", "must be at least 1s")
		}
		if jt.ThrottleFactor < 1 {
			bad(p+".throttle_factor", "must be at least 1")
		} else if q != nil && !jt.Critical && q.ThrottleLimit > 0 && jt.ThrottleFactor > q.ThrottleLimit {
			bad(p+".throttle_factor", "%d is larger than queue %q's throttle_limit %d", jt.ThrottleFactor, q.Name, q.ThrottleLimit)
		}
		if jt.MaxConcurrency < 0 {
			bad(p+".max_concurrency", "must not be negative")
		}
		oneOf(p+".delivery", jt.Delivery, string(correlator.AtLeastOnce), string(correlator.AtMostOnce))
		if r := jt.Retry; r != nil {
			if r.MaxAttempts < 1 {
				bad(p+".retry.max_attempts", "must be at least 1")
			}
			oneOf(p+".retry.backoff", r.Backoff, "fixed", "exponential")
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
				} else if o == correlator.AttemptTimedOut && jt.Delivery == string(correlator.AtMostOnce) {
					bad(fmt.Sprintf("%s.retry.when[%d]", p, k), "at_most_once types may not retry timed_out: the request may have arrived")
				}
			}
		}
		for k := range jt.TimeWindows {
			if err := jt.TimeWindows[k].Compile(); err != nil {
				bad(fmt.Sprintf("%s.time_windows[%d]", p, k), "%v", err)
			}
		}
	}
	if len(errs) > 0 {
		return errs
	}
	return nil
}

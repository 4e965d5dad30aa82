// Package config reads hipq's one YAML file: environment expansion,
// defaults, and validation that reports every problem at once with the
// field's path. Only cmd/hipq reads it and maps it onto each component.
package config

import (
	"strings"
	"time"

	"github.com/hipq/hipq/consumer"
	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/memlimit"
	"github.com/hipq/hipq/schemas"
)

// Config is the whole file.
type Config struct {
	// dir is the config file's folder: relative file paths start there.
	dir string
	// Name names the deployment; consumer groups default to {name}-intake and
	// {name}-responses. Defaults to hipq.
	Name      string    `yaml:"name"`
	Database  Database  `yaml:"database"`
	Kafka     Kafka     `yaml:"kafka"`
	Intake    Intake    `yaml:"intake"`
	Responses Responses `yaml:"responses"`
	Dispatch  Dispatch  `yaml:"dispatch"`
	Sweeper   Sweeper   `yaml:"sweeper"`
	// API is the HTTP server; absent means none.
	API *API `yaml:"api,omitempty"`
	// Metrics is where every instance serves /metrics, /healthz and /readyz.
	Metrics Metrics `yaml:"metrics"`
	// ShutdownTimeout bounds the drain after SIGTERM. Defaults to 15s.
	ShutdownTimeout Duration `yaml:"shutdown_timeout"`
	// MemoryLimit bounds the process's memory: the Go runtime's soft
	// limit, and the consumers' fetches and producers' buffers drawn from
	// it (internal/memlimit). Unset: GOMEMLIMIT, else 90% of the cgroup's
	// limit, else 64MiB; resolved at start, so not filled in here. At
	// least 32MiB.
	MemoryLimit ByteSize  `yaml:"memory_limit,omitempty"`
	Log         Log       `yaml:"log"`
	Tracing     Tracing   `yaml:"tracing"`
	Queues      []Queue   `yaml:"queues"`
	JobTypes    []JobType `yaml:"job_types"`
	// Schedules are periodic jobs, fired by the sweeper role.
	Schedules []Schedule `yaml:"schedules"`
	// Events are the defaults of every job type's outcome events, and
	// which reply_to topics a job may name. Off unless configured.
	Events Events `yaml:"events"`
}

// Events publish how jobs end to Kafka (docs/messages.md, "Outcome
// events").
type Events struct {
	// Topic receives the events of every job type that names none of its
	// own. Empty: no events but those a type asks for.
	Topic string `yaml:"topic"`
	// On says which ends make an event: final (the job's end) and attempt
	// (also each attempt that ends in a retry). Defaults to [final].
	On []string `yaml:"on,omitempty"`
	// AllowedReplyTo are patterns (path.Match: '*' matches any run of
	// characters) of the topics a job may name as its own reply_to
	// (intake header hipq-reply-to, the API's reply_to). Defaults to none:
	// no producer makes hipq write to a topic of its choosing.
	AllowedReplyTo []string `yaml:"allowed_reply_to,omitempty"`
}

// JobEvents are a job type's outcome events; fields left out take the
// top-level events' values.
type JobEvents struct {
	// Topic receives the type's events. Defaults to events.topic.
	Topic string `yaml:"topic"`
	// On: final and/or attempt; an empty list turns the type's events
	// off. Defaults to events.on.
	On []string `yaml:"on"`
}

// Schedule is a periodic job: a cron timetable and the job each tick
// enqueues.
type Schedule struct {
	// Name is required and unique; it keys the schedule's row, so a
	// renamed schedule starts afresh.
	Name string `yaml:"name"`
	// Cron: five fields, or a descriptor (@daily, @every 10m).
	Cron string `yaml:"cron"`
	// TZ is the zone the cron fields read in. Defaults to UTC.
	TZ      string `yaml:"tz"`
	JobType string `yaml:"job_type"`
	// JobKey is a text/template over {Time, Name}: Time is the tick in TZ.
	JobKey  string `yaml:"job_key"`
	JobData any    `yaml:"job_data"`
	// CatchUp is what happens to ticks missed while no instance ran:
	// latest (default), none, or all (at most 100).
	CatchUp correlator.CatchUp `yaml:"catch_up"`
	// CatchUpWindow: ticks older than this never fire. Defaults to 24h.
	CatchUpWindow Duration `yaml:"catch_up_window"`
	// Overlap: allow (default) or skip (no fire while the last job is not final).
	Overlap correlator.Overlap `yaml:"overlap"`
	// compiled is the schedule, by Validate.
	compiled *correlator.Schedule
}

// Database is PostgreSQL.
type Database struct {
	// URL is a libpq connection string or URL. Required.
	URL string `yaml:"url" secret:"url"`
	// Schema keeps deployments apart in one database. Defaults to public.
	Schema string `yaml:"schema"`
	// MaxConns is the pool size. Defaults to 10.
	MaxConns int `yaml:"max_conns"`
	// Migrate applies migrations at start. Defaults to true.
	Migrate *bool `yaml:"migrate"`
	// Citus says whether the database is a Citus cluster whose per-queue
	// tables migrate distributes by queue: auto (default: when the citus
	// extension is in the database), on or off.
	Citus string `yaml:"citus"`
}

// Kafka is the cluster.
type Kafka struct {
	// Brokers are seed addresses. Required.
	Brokers []string `yaml:"brokers"`
	// ClientID defaults to the deployment name.
	ClientID string `yaml:"client_id"`
	// SessionTimeout is how soon a dead instance's partitions move. Defaults to 10s.
	SessionTimeout Duration `yaml:"session_timeout"`
	// MaxRecordBytes is the largest record hipq's producer writes (franz-go's
	// ProducerBatchMaxBytes, Kafka's max.request.size). Defaults to
	// 1000012, the producer's default; the brokers' and topics'
	// message.max.bytes must allow it.
	MaxRecordBytes int `yaml:"max_record_bytes"`
	// Compression is the codec of the records hipq writes (requests,
	// dead-letter copies): none (default, as Kafka's producer), gzip,
	// snappy, lz4 or zstd. A consumer must be able to read it: kafkajs, for
	// one, reads only none and gzip without extra codecs.
	Compression string `yaml:"compression"`
	// IsolationLevel is what the consumers read of transactional
	// producers' records: read_committed (default: records of aborted
	// transactions are never seen) or read_uncommitted.
	IsolationLevel string `yaml:"isolation_level"`
	TLS            TLS    `yaml:"tls"`
	SASL           SASL   `yaml:"sasl"`
}

// TLS to the brokers. Relative file paths start at the config file's
// folder.
type TLS struct {
	Enabled bool `yaml:"enabled"`
	// CAFile holds the PEM certificates that sign the brokers'; empty: the
	// system's roots.
	CAFile string `yaml:"ca_file"`
	// ServerName is the name the brokers' certificates must carry, when it
	// is not the host name in kafka.brokers (brokers reached by IP or
	// through a tunnel). Empty: the host name dialled.
	ServerName string `yaml:"server_name"`
	// CertFile and KeyFile are hipq's client certificate and its key, PEM,
	// for brokers that demand mutual TLS; both or neither.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
}

// SASL to the brokers.
type SASL struct {
	// Mechanism is empty (none), PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.
	Mechanism string `yaml:"mechanism"`
	Username  string `yaml:"username"`
	Password  string `yaml:"password" secret:"true"`
}

// Intake is the consumer of job requests.
type Intake struct {
	// Topics to read; none means no intake consumer.
	Topics []string `yaml:"topics"`
	// Group defaults to {name}-intake.
	Group string `yaml:"group"`
	// DeadLetterTopic gets a copy of each bad record; optional.
	DeadLetterTopic string `yaml:"dead_letter_topic"`
	// MaxBytes is the largest record value accepted (and the API's body
	// limit). A job must fit in one request record with hipq's key,
	// headers and envelope, so MaxBytes plus RecordOverhead may not pass
	// kafka.max_record_bytes. Defaults to 983040 (960 KiB).
	MaxBytes int `yaml:"max_bytes"`
	// Start is where a partition with no stored offset begins: earliest
	// (default) or latest.
	Start consumer.Start `yaml:"start"`
	// Outbox drains hipq_intake, the transactional outbox, in the intake
	// role. Defaults to true.
	Outbox *bool `yaml:"outbox"`
}

// Responses is the consumer of replies.
type Responses struct {
	// Group defaults to {name}-responses.
	Group string `yaml:"group"`
	// Start: earliest (default) or latest.
	Start consumer.Start `yaml:"start"`
	// EarlyTTL is how long a reply for a job not yet dispatched is kept. Defaults to 10m.
	EarlyTTL Duration `yaml:"early_ttl"`
	// DeadLetterTopic gets a copy of each unusable reply; optional.
	DeadLetterTopic string          `yaml:"dead_letter_topic"`
	Topics          []ResponseTopic `yaml:"topics"`
}

// ResponseTopic is one response topic and where its fields are. Fields
// left out take the defaults (the hipq-* headers, {json: /status}, …).
type ResponseTopic struct {
	Topic     string            `yaml:"topic"`
	JobID     *correlator.Field `yaml:"job_id,omitempty"`
	JobType   *correlator.Field `yaml:"job_type,omitempty"`
	JobKey    *correlator.Field `yaml:"job_key,omitempty"`
	Attempt   *correlator.Field `yaml:"attempt,omitempty"`
	Status    *StatusField      `yaml:"status,omitempty"`
	Retryable *correlator.Field `yaml:"retryable,omitempty"`
	// RetryAfter: where a failure says when to try again (seconds or a
	// time); defaults to {json: /retry_after}.
	RetryAfter *correlator.Field `yaml:"retry_after,omitempty"`
	Error      *correlator.Field `yaml:"error,omitempty"`
	Result     *correlator.Field `yaml:"result,omitempty"`
}

// StatusField is a field plus its success and failure values.
type StatusField struct {
	correlator.Field `yaml:",inline"`
	Success          []string `yaml:"success,omitempty"`
	Failure          []string `yaml:"failure,omitempty"`
	// Progress values mark news of a running attempt. Defaults to [progress].
	Progress []string `yaml:"progress,omitempty"`
}

// Dispatch is the dispatcher.
type Dispatch struct {
	// Interval between polls for due jobs. Defaults to 1s.
	Interval Duration `yaml:"interval"`
	// BatchSize is the most jobs claimed per queue per round. Defaults to 500.
	BatchSize int `yaml:"batch_size"`
	// Grace is added to a transport's send timeout before the sweeper takes
	// an unsent claim for dead. Defaults to 1m.
	Grace Duration `yaml:"grace"`
}

// Sweeper is the periodic maintenance.
type Sweeper struct {
	// Schedule in robfig/cron syntax. Defaults to "@every 15s".
	Schedule string `yaml:"schedule"`
	// Retention of final jobs. Defaults to 720h.
	Retention Duration `yaml:"retention"`
	// DeadLetterRetention of dead letters. Defaults to 720h.
	DeadLetterRetention Duration `yaml:"dead_letter_retention"`
}

// API is the HTTP server.
type API struct {
	// Listen address. Defaults to 127.0.0.1:8080.
	Listen string `yaml:"listen"`
	// TLS serves HTTPS on listen; absent: plain HTTP.
	TLS *APITLS `yaml:"tls,omitempty"`
	// PublicURL is how downstreams reach the API (callback URLs).
	// Defaults to http://{listen}, https:// with tls.
	PublicURL string `yaml:"public_url"`
	// Tokens are accepted bearer tokens, each at least 32 bytes, with the
	// admin role: they read and change (enqueue, cancel, pause, replay).
	Tokens []string `yaml:"tokens" secret:"true"`
	// ReadTokens are bearer tokens with the read role: GET only, in the
	// API and the dashboard. Each at least 32 bytes.
	ReadTokens []string `yaml:"read_tokens" secret:"true"`
	// CallbackSecret signs callback URLs; required, at least 32 bytes.
	CallbackSecret string `yaml:"callback_secret" secret:"true"`
	// MaxConns bounds the API's own PostgreSQL connections, apart from
	// database.max_conns (intake, dispatch, replies), so API load never
	// takes the hot path's. Defaults to 4.
	MaxConns int `yaml:"max_conns"`
	// RequestTimeout bounds each API request, its statements included
	// (statement_timeout on the API's connections). Defaults to 10s.
	RequestTimeout Duration `yaml:"request_timeout"`
	// UI is the dashboard the API serves at {path_prefix}/ui/.
	UI UI `yaml:"ui"`
}

// APITLS is the API's certificate. The files are read again when they
// change, so a rotated certificate is served from the next connection on
// without a restart. Relative paths start at the config file's folder.
type APITLS struct {
	// CertFile is the PEM certificate chain, the server's first. Required.
	CertFile string `yaml:"cert_file"`
	// KeyFile is its PEM private key. Required.
	KeyFile string `yaml:"key_file"`
}

// Metrics is where /metrics, /healthz and /readyz are served.
type Metrics struct {
	// Listen is their address. Defaults to :9464 without an api section;
	// with one, they are served on the API's listener (and on :9464 by an
	// instance not running the api role).
	Listen string `yaml:"listen"`
}

// UI is the web dashboard.
type UI struct {
	// Disabled turns the dashboard off; it is on wherever the API runs.
	Disabled bool `yaml:"disabled"`
	// PathPrefix is where a reverse proxy mounts hipq (e.g. /hipq): the
	// dashboard is served at {path_prefix}/ui/ and links there. Empty: /ui/.
	PathPrefix string `yaml:"path_prefix"`
	// Redact lists JSON pointers (e.g. /card/number) of job_data fields the
	// dashboard shows as "[redacted]".
	Redact []string `yaml:"redact"`
	// SessionTTL is how long a dashboard session lasts unused; each use
	// moves its end to session_ttl from then. Defaults to 12h.
	SessionTTL Duration `yaml:"session_ttl"`
}

// Tracing exports OpenTelemetry traces over OTLP/HTTP.
type Tracing struct {
	// Endpoint is the OTLP/HTTP collector's base URL, e.g.
	// http://collector:4318. Empty: the OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
	// or OTEL_EXPORTER_OTLP_ENDPOINT variable; without either, tracing is
	// off and costs nothing.
	Endpoint string `yaml:"endpoint"`
	// Sampler is one of OpenTelemetry's: always_on, always_off,
	// traceidratio, parentbased_always_on, parentbased_always_off or
	// parentbased_traceidratio. Defaults to OTEL_TRACES_SAMPLER, else
	// parentbased_traceidratio. parent_ratio, hipq's former name of
	// parentbased_traceidratio, is accepted with a warning.
	Sampler string `yaml:"sampler"`
	// Ratio of the traces the ratio samplers start, 0 to 1. Defaults to
	// OTEL_TRACES_SAMPLER_ARG, else 1.
	Ratio float64 `yaml:"ratio"`
	// ServiceName defaults to OTEL_SERVICE_NAME, else name.
	ServiceName string `yaml:"service_name"`
	// Link makes each send span link to the job's intake trace instead of
	// joining it as a child.
	Link bool `yaml:"link"`
	// BatchTimeout is how long finished spans wait to be exported in a
	// batch; defaults to the SDK's (OTEL_BSP_SCHEDULE_DELAY, else 5s).
	BatchTimeout Duration `yaml:"batch_timeout"`
}

// Log is logging.
type Log struct {
	// Level: debug, info (default), warn, error.
	Level string `yaml:"level"`
	// Format: json (default) or console.
	Format string `yaml:"format"`
}

// Queue is a set of job types sharing one throttle and one ordering.
type Queue struct {
	Name string `yaml:"name"`
	// Order: scheduled_first (default) or priority_first.
	Order correlator.Order `yaml:"order"`
	// ThrottleLimit is the most total throttle_factor of running jobs; 0 = unlimited.
	ThrottleLimit int     `yaml:"throttle_limit"`
	Shares        *Shares `yaml:"shares,omitempty"`
	// Rates limit the requests sent of every type of the queue.
	Rates []Rate `yaml:"rates,omitempty"`
}

// Rate is a sliding-window limit on requests sent: no interval of length
// period holds more than limit, across all instances.
type Rate struct {
	Limit  int      `yaml:"limit"`
	Period Duration `yaml:"period"`
	// By makes a window per value of a job_data field ({json: /tenant}).
	By *correlator.Field `yaml:"by,omitempty"`
}

// Shares split a queue's limit among partitions of its jobs.
type Shares struct {
	By      correlator.Field `yaml:"by"`
	Weights map[string]int   `yaml:"weights"`
}

// JobType is a kind of job.
type JobType struct {
	Name string `yaml:"name"`
	// Queue defaults to default.
	Queue     string    `yaml:"queue"`
	Transport Transport `yaml:"transport"`
	// ReplyTopic must be one of responses.topics; optional.
	ReplyTopic string `yaml:"reply_topic"`
	// Timeout is how long a reply is awaited without news. Defaults to 24h.
	Timeout Duration `yaml:"timeout"`
	// HeartbeatTimeout is how long a running job waits after news (a
	// progress reply or a heartbeat). Defaults to timeout.
	HeartbeatTimeout Duration `yaml:"heartbeat_timeout"`
	// MaxTimeout caps a running attempt from its start, news or not.
	// Defaults to timeout (news then extends nothing).
	MaxTimeout Duration `yaml:"max_timeout"`
	// Priority defaults to 100; lower runs first.
	Priority *int `yaml:"priority"`
	// ThrottleFactor defaults to 1.
	ThrottleFactor int `yaml:"throttle_factor"`
	// MaxConcurrency caps running jobs of this type; 0 = no cap.
	MaxConcurrency int  `yaml:"max_concurrency"`
	Critical       bool `yaml:"critical"`
	// Delivery: at_least_once (default) or at_most_once.
	Delivery    correlator.Delivery     `yaml:"delivery"`
	Retry       *Retry                  `yaml:"retry,omitempty"`
	TimeWindows []correlator.TimeWindow `yaml:"time_windows,omitempty"`
	// Rates limit the requests sent of this type.
	Rates []Rate `yaml:"rates,omitempty"`
	// DataSchema is a JSON Schema file (draft 2020-12 unless it says
	// otherwise) that job_data must satisfy at intake; relative to the
	// config file's folder. Optional.
	DataSchema string `yaml:"data_schema,omitempty"`
	// dataSchema is DataSchema compiled, by Validate.
	dataSchema *schemas.DataSchema
	// Events are the type's outcome events. Defaults to the top-level
	// events section.
	Events *JobEvents `yaml:"events,omitempty"`
}

// Transport names exactly one of kafka or http.
type Transport struct {
	Kafka *KafkaTransport `yaml:"kafka,omitempty"`
	HTTP  *HTTPTransport  `yaml:"http,omitempty"`
}

// KafkaTransport produces requests to a topic.
type KafkaTransport struct {
	Topic string `yaml:"topic"`
	// Envelope wraps job_data with its identifiers.
	Envelope bool `yaml:"envelope"`
	// Compression of this type's requests; defaults to kafka.compression.
	Compression string `yaml:"compression"`
}

// HTTPTransport calls a URL.
type HTTPTransport struct {
	URL     string            `yaml:"url"`
	Method  string            `yaml:"method"`
	Headers map[string]string `yaml:"headers,omitempty" secret:"true"`
	// Timeout of one call. Defaults to 10s.
	Timeout Duration `yaml:"timeout"`
	// Mode: async (default) or sync.
	Mode dispatcher.HTTPMode `yaml:"mode"`
	// timeoutDefaulted: Timeout was left out and is the default.
	timeoutDefaulted bool
	// MaxInFlight bounds this type's calls at once on each instance: a
	// slow downstream holds its own type's slots, never another's.
	// Defaults to 64.
	MaxInFlight int `yaml:"max_in_flight"`
	// TLS of this type's calls to an https url; absent: the system's
	// roots, no client certificate.
	TLS *HTTPTLS `yaml:"tls,omitempty"`
}

// HTTPTLS is the TLS of one job type's HTTP calls. Relative paths start
// at the config file's folder.
type HTTPTLS struct {
	// CAFile holds the PEM certificates that sign the downstream's (a
	// private CA); empty: the system's roots.
	CAFile string `yaml:"ca_file"`
	// CertFile and KeyFile are hipq's client certificate and key (PEM),
	// for a downstream that demands mutual TLS; both or neither. Read
	// again when their files change.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
}

// Retry is a job type's retry policy; keys left out take the values
// max_attempts 5, exponential, initial 10s, multiplier 2, max 1h, jitter 0.1.
type Retry struct {
	MaxAttempts int      `yaml:"max_attempts"`
	Backoff     string   `yaml:"backoff"`
	Initial     Duration `yaml:"initial"`
	Multiplier  float64  `yaml:"multiplier"`
	Max         Duration `yaml:"max"`
	Jitter      *float64 `yaml:"jitter"`
	When        []string `yaml:"when,omitempty"`
}

// Duration is a time.Duration written as "10s" in YAML.
type Duration time.Duration

// D returns the time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// MarshalYAML writes the duration as text.
func (d Duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

// ByteSize is a number of bytes, written in YAML as a whole number or with
// a unit: 64MiB, 512MB, 1GiB.
type ByteSize int64

// MarshalYAML writes the size in the largest binary unit that divides it,
// else in bytes.
func (b ByteSize) MarshalYAML() (any, error) {
	if s := memlimit.Format(int64(b)); !strings.Contains(s, ".") {
		return s, nil
	}
	return int64(b), nil
}

package config

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
)

const minimal = `
database: {url: "${DB_URL}"}
kafka: {brokers: ["localhost:9092"]}
`

func env(kv map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := kv[k]; return v, ok }
}

func TestDefaults(t *testing.T) {
	cfg, err := Parse(minimal, env(map[string]string{"DB_URL": "postgres://u:secretpw@db/hipq"}))
	if err != nil {
		t.Fatal(err)
	}
	withAPI, err := Parse(minimal+"api: {callback_secret: "+strings.Repeat("s", 32)+"}\n", env(map[string]string{"DB_URL": "x"}))
	if err != nil {
		t.Fatal(err)
	}
	checks := []struct {
		name      string
		got, want any
	}{
		{"name", cfg.Name, "hipq"},
		{"intake group", cfg.Intake.Group, "hipq-intake"},
		{"responses group", cfg.Responses.Group, "hipq-responses"},
		{"intake start", string(cfg.Intake.Start), "earliest"},
		{"max bytes", cfg.Intake.MaxBytes, 960 << 10},
		{"early ttl", cfg.Responses.EarlyTTL.D(), 10 * time.Minute},
		{"interval", cfg.Dispatch.Interval.D(), time.Second},
		{"batch", cfg.Dispatch.BatchSize, 500},
		{"grace", cfg.Dispatch.Grace.D(), time.Minute},
		{"schedule", cfg.Sweeper.Schedule, "@every 15s"},
		{"retention", cfg.Sweeper.Retention.D(), 720 * time.Hour},
		{"shutdown", cfg.ShutdownTimeout.D(), 15 * time.Second},
		{"migrate", *cfg.Database.Migrate, true},
		{"citus", cfg.Database.Citus, "auto"},
		{"default queue", cfg.Queues[0].Name, "default"},
		{"session timeout", cfg.Kafka.SessionTimeout.D(), 10 * time.Second},
		{"metrics listen without an api", cfg.Metrics.Listen, ":9464"},
		{"metrics listen with an api (the API's listener)", withAPI.Metrics.Listen, ""},
		{"dashboard session ttl", withAPI.API.UI.SessionTTL.D(), 12 * time.Hour},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
}

func TestGroupsFollowName(t *testing.T) {
	cfg, err := Parse("name: billing\n"+minimal, env(map[string]string{"DB_URL": "x"}))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Intake.Group != "billing-intake" || cfg.Responses.Group != "billing-responses" {
		t.Errorf("groups %q, %q do not follow name", cfg.Intake.Group, cfg.Responses.Group)
	}
}

func TestRetryDefaultsFillLeftOutKeys(t *testing.T) {
	cfg, err := Parse(minimal+`
job_types:
  - name: a
    transport: {kafka: {topic: a.req}}
    retry: {initial: 3s}
  - name: b
    delivery: at_most_once
    transport: {kafka: {topic: b.req}}
    retry: {max_attempts: 2}
`, env(map[string]string{"DB_URL": "x"}))
	if err != nil {
		t.Fatal(err)
	}
	a := cfg.JobTypes[0].Retry
	if a.MaxAttempts != 5 || a.Backoff != "exponential" || a.Initial.D() != 3*time.Second || a.Multiplier != 2 ||
		a.Max.D() != time.Hour || *a.Jitter != 0.1 || strings.Join(a.When, ",") != "failed,timed_out,dispatch_error" {
		t.Errorf("retry defaults: %+v", a)
	}
	if w := strings.Join(cfg.JobTypes[1].Retry.When, ","); w != "failed,dispatch_error" {
		t.Errorf("at_most_once when = %s", w)
	}
	d := cfg.Domain()
	if d["a"].Retry.MaxAttempts() != 5 || d["b"].Retry.MaxAttempts() != 2 || d["a"].Priority != 100 {
		t.Errorf("domain mapping wrong: %+v %+v", d["a"], d["b"])
	}
}

// TestProblems: every problem is reported at once, each with its path.
func TestProblems(t *testing.T) {
	text := `
name: "bad name!"
database: {url: "${MISSING}", max_conns: -1}
kafka: {brokers: [], sasl: {mechanism: KERBEROS}}
intake: {start: middle, topics: [jobs]}
dispatch: {interval: -1s, batch_size: -5}
sweeper: {schedule: "every now and then"}
api: {callback_secret: short, tokens: [tiny], read_tokens: [small], ui: {path_prefix: "hipq/", redact: [card], session_ttl: 10s}}
metrics: {listen: "9464"}
tracing: {sampler: parentbased_always_on, ratio: 0.5}
log: {level: loud}
queues:
  - {name: q1, throttle_limit: -1, shares: {by: {json: /region}, weights: {east: 0}}}
  - {name: q1}
job_types:
  - name: a
    queue: nowhere
    transport: {kafka: {topic: t}, http: {url: "http://x"}}
  - name: b
    transport: {kafka: {topic: ""}}
    reply_topic: not.a.response.topic
    delivery: at_most_once
    retry: {when: [failed, timed_out], jitter: 2}
    time_windows: [{start: "5am", end: "07:00"}]
  - name: a
    transport: {kafka: {topic: x}}
    tiemout: 5s
    retry: {initial: soon}
`
	_, err := Parse(text, env(nil))
	var ce Errors
	if !errors.As(err, &ce) {
		t.Fatalf("got %v, want Errors", err)
	}
	// Issue 9.15: one run names every problem, the unknown key, the bad
	// duration and the unset variable beside every semantic one.
	semantic := []string{
		"name:", "database.max_conns:", "kafka.brokers:", "kafka.sasl.mechanism:", "intake.start:",
		"dispatch.interval:", "dispatch.batch_size:", "sweeper.schedule:", "api.callback_secret:", "api.tokens[0]:",
		"api.read_tokens[0]:", "api.ui.path_prefix:", "api.ui.redact[0]:", "api.ui.session_ttl:",
		"metrics.listen:", "tracing.ratio:", "log.level:", "queues[0].throttle_limit:", "queues[0].shares:", "queues[0].shares.weights.east:", "queues[1].name:",
		"job_types[0].queue:", "job_types[0].transport:", "job_types[1].transport.kafka.topic:", "job_types[1].reply_topic:",
		"job_types[1].retry.when[1]:", "job_types[1].retry.jitter:", "job_types[1].time_windows[0]:", "job_types[2].name:",
	}
	for _, want := range append([]string{
		"database.url: environment variable MISSING is not set",
		"job_types[2].tiemout: unknown key",
		"job_types[2].retry.initial:",
	}, semantic...) {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("missing %q in:\n%v", want, err)
		}
	}
	if n := strings.Count(err.Error(), "database.url:"); n != 1 {
		t.Errorf("database.url reported %d times, want once:\n%v", n, err)
	}
	text = strings.Replace(strings.Replace(text, "tiemout: 5s", "timeout: 5s", 1), "initial: soon", "initial: 1s", 1)
	_, err = Parse(text, env(map[string]string{"MISSING": "postgres://x"}))
	for _, want := range semantic {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("missing %q in:\n%v", want, err)
		}
	}
}

func TestEnvExpansion(t *testing.T) {
	cfg, err := Parse(`
database: {url: "${DB_URL}", max_conns: "${CONNS}", schema: "${SCHEMA}"}
kafka: {brokers: ["${BROKER:-localhost:9092}"]}
`, env(map[string]string{"DB_URL": "postgres://h/db", "CONNS": "7", "SCHEMA": "123"}))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Database.URL != "postgres://h/db" || cfg.Database.MaxConns != 7 || cfg.Database.Schema != "123" || cfg.Kafka.Brokers[0] != "localhost:9092" {
		t.Errorf("expansion: %+v %+v", cfg.Database, cfg.Kafka.Brokers)
	}
}

func TestRedacted(t *testing.T) {
	cfg, err := Parse(`
database: {url: "postgres://hipq:dbpass123@db:5432/hipq?sslmode=disable"}
kafka: {brokers: [k:9092], sasl: {mechanism: PLAIN, username: u, password: saslpass123}}
api: {tokens: ["tok-0123456789-0123456789-0123456789"], callback_secret: "cbs-0123456789-0123456789-0123456789"}
job_types:
  - name: h
    transport: {http: {url: "https://svc/x", headers: {X-Api-Key: apikey123}, timeout: 5s}}
    timeout: 1m
`, nil)
	if err != nil {
		t.Fatal(err)
	}
	out := cfg.Redacted()
	for _, secret := range []string{"dbpass123", "saslpass123", "tok-0123456789", "cbs-0123456789", "apikey123"} {
		if strings.Contains(out, secret) {
			t.Errorf("effective config shows %q:\n%s", secret, out)
		}
	}
	if !strings.Contains(out, "REDACTED") || !strings.Contains(out, "username: u") {
		t.Errorf("unexpected redaction:\n%s", out)
	}
	if cfg.Kafka.SASL.Password != "saslpass123" || cfg.API.Tokens[0][:3] != "tok" {
		t.Error("redaction changed the config itself")
	}
}

func FuzzParse(f *testing.F) {
	f.Add(minimal)
	f.Add("name: x\nqueues: [{name: q, throttle_limit: 3}]\njob_types: [{name: a, queue: q, transport: {kafka: {topic: t}}}]")
	f.Add("a: [")
	f.Fuzz(func(t *testing.T, text string) {
		cfg, err := Parse(text, env(map[string]string{"DB_URL": "x"}))
		if err == nil {
			if cfg.Database.URL == "" || len(cfg.Kafka.Brokers) == 0 {
				t.Fatalf("accepted without database or brokers: %q", text)
			}
			_ = cfg.Redacted()
			return
		}
		var ce Errors
		if !errors.As(err, &ce) || len(ce) == 0 {
			t.Fatalf("error is not Errors: %v", err)
		}
	})
}

// Throttles: a type heavier than its queue's limit is an error unless it
// is critical (critical types count against no limit); Throttles and Domain
// carry the limits, shares, critical types and caps to the claim and intake.
func TestThrottles(t *testing.T) {
	text := minimal + `
queues:
  - {name: q, throttle_limit: 10, shares: {by: {json: /region}, weights: {east: 3, "*": 1}}}
job_types:
  - {name: heavy, queue: q, throttle_factor: 11, transport: {kafka: {topic: t}}}
  - {name: crit, queue: q, throttle_factor: 11, critical: true, max_concurrency: 2, transport: {kafka: {topic: t}}}
`
	_, err := Parse(text, env(map[string]string{"DB_URL": "postgres://x"}))
	if err == nil || !strings.Contains(err.Error(), "job_types[0].throttle_factor:") || strings.Contains(err.Error(), "job_types[1]") {
		t.Fatalf("want only job_types[0].throttle_factor refused, got %v", err)
	}
	c, err := Parse(strings.Replace(text, "throttle_factor: 11, transport", "throttle_factor: 2, transport", 1), env(map[string]string{"DB_URL": "postgres://x"}))
	if err != nil {
		t.Fatal(err)
	}
	th := c.Throttles()["q"]
	if th.Limit != 10 || th.Shares == nil || th.Shares.Caps["east"] != 7 || th.Shares.OtherCap != 2 ||
		len(th.Critical) != 1 || th.Critical[0] != "crit" || th.MaxConcurrency["crit"] != 2 {
		t.Fatalf("throttle %+v shares %v", th, th.Shares)
	}
	if d := c.Domain()["crit"]; !d.Critical || d.MaxConcurrency != 2 || d.Shares == nil || d.QueueLimit != 10 {
		t.Fatalf("domain %+v", d)
	}
	if th := c.Throttles()["default"]; th.Bounded() {
		t.Fatalf("the default queue is bounded: %+v", th)
	}
}

// Issue 9.6: intake.max_bytes is tied to what the producer can send: with a
// Kafka transport, a job as large as it allows must fit in one record.
func TestMaxBytesFitsARecord(t *testing.T) {
	base := `
database: {url: "postgres://x"}
kafka: {brokers: [k:9092]%s}
intake: {max_bytes: %d}
job_types: [{name: a, transport: {kafka: {topic: t}}}]
`
	if _, err := Parse(fmt.Sprintf(base, "", 1<<20), env(nil)); err == nil || !strings.Contains(err.Error(), "intake.max_bytes: 1048576 plus 8192 bytes") {
		t.Fatalf("1 MiB under the producer's default: %v", err)
	}
	if _, err := Parse(fmt.Sprintf(base, ", max_record_bytes: 2000000", 1<<20), env(nil)); err != nil {
		t.Fatalf("1 MiB under a 2 MB record limit: %v", err)
	}
	if _, err := Parse(fmt.Sprintf(base, "", DefaultMaxBytes), env(nil)); err != nil {
		t.Fatalf("the defaults: %v", err)
	}
	cfg, err := Parse(`
database: {url: "postgres://x"}
kafka: {brokers: [k:9092]}
api: {callback_secret: "`+strings.Repeat("s", 32)+`"}
job_types: [{name: h, timeout: 5s, transport: {http: {url: "http://x/y"}}}]
`, env(nil))
	if err == nil || !strings.Contains(err.Error(), "the default of 10s must be shorter than the type's timeout 5s: set transport.http.timeout below 5s") {
		t.Fatalf("a defaulted HTTP timeout over the type's: %v %v", cfg, err)
	}
}

// Issue 16: an unknown compression is refused with its path, for the
// cluster and for a type.
func TestCompressionNames(t *testing.T) {
	_, err := Parse(`
database: {url: "postgres://x"}
kafka: {brokers: [k:9092], compression: brotli}
job_types: [{name: a, transport: {kafka: {topic: t, compression: LZ4}}}]
`, env(nil))
	for _, want := range []string{`kafka.compression: "brotli" is not one of`, `job_types[0].transport.kafka.compression: "LZ4" is not one of`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("missing %q in %v", want, err)
		}
	}
	cfg, err := Parse("database: {url: \"postgres://x\"}\nkafka: {brokers: [k:9092]}\n", env(nil))
	if err != nil || cfg.Kafka.Compression != "none" {
		t.Fatalf("default compression %q, %v", cfg.Kafka.Compression, err)
	}
}

// database.citus is auto, on or off; anything else is refused naming the
// field and the choices.
func TestCitusChoice(t *testing.T) {
	_, err := Parse("database: {url: \"postgres://x\", citus: yes}\nkafka: {brokers: [k:9092]}\n", env(nil))
	if want := `database.citus: "yes" is not one of [auto on off]`; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("missing %q in %v", want, err)
	}
	cfg, err := Parse("database: {url: \"postgres://x\", citus: \"off\"}\nkafka: {brokers: [k:9092]}\n", env(nil))
	if err != nil || cfg.Database.Citus != "off" {
		t.Fatalf("citus off: %q, %v", cfg.Database.Citus, err)
	}
}

// tracing.sampler takes OpenTelemetry's names, and hipq's former
// parent_ratio for now; anything else is refused naming them.
func TestSamplerNames(t *testing.T) {
	for _, s := range []string{"always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
		"parentbased_traceidratio", "parent_ratio"} {
		if _, err := Parse(minimal+"tracing: {sampler: "+s+"}\n", env(map[string]string{"DB_URL": "x"})); err != nil {
			t.Errorf("%s: %v", s, err)
		}
	}
	_, err := Parse(minimal+"tracing: {sampler: sometimes}\n", env(map[string]string{"DB_URL": "x"}))
	if err == nil || !strings.Contains(err.Error(), `tracing.sampler: "sometimes" is not one of OpenTelemetry's always_on, always_off, traceidratio`) {
		t.Errorf("a bad sampler: %v", err)
	}
}

// TestEvents: the top-level events section is every type's default, a
// type's own section replaces it field by field, and the domain gets
// each type's topic, occasions and the reply_to patterns.
func TestEvents(t *testing.T) {
	cfg, err := Parse(minimal+`
events: {topic: hipq.events, allowed_reply_to: ["replies.*", "svc-?"]}
job_types:
  - name: plain
    transport: {kafka: {topic: p.req}}
  - name: own
    transport: {kafka: {topic: o.req}}
    events: {topic: own.events, on: [final, attempt]}
  - name: attempts
    transport: {kafka: {topic: a.req}}
    events: {on: [attempt]}
  - name: quiet
    transport: {kafka: {topic: q.req}}
    events: {on: []}
`, env(map[string]string{"DB_URL": "x"}))
	if err != nil {
		t.Fatal(err)
	}
	d := cfg.Domain()
	want := map[string]correlator.Events{
		"plain":    {Topic: "hipq.events"},
		"own":      {Topic: "own.events", Attempts: true},
		"attempts": {Topic: "hipq.events", Attempts: true},
		"quiet":    {},
	}
	for name, w := range want {
		if got := d[name].Events; got != w {
			t.Errorf("%s events = %+v, want %+v", name, got, w)
		}
	}
	if got := d["plain"].AllowedReplyTo; strings.Join(got, ",") != "replies.*,svc-?" {
		t.Errorf("allowed_reply_to = %v", got)
	}
	if err := d["plain"].CheckReplyTo("replies.billing"); err != nil {
		t.Errorf("replies.billing refused: %v", err)
	}
	if err := d["plain"].CheckReplyTo("other"); err == nil || !strings.HasPrefix(err.Error(), correlator.CodeReplyToNotAllowed+":") {
		t.Errorf("other: got %v, want %s", err, correlator.CodeReplyToNotAllowed)
	}

	none, err := Parse(minimal+"job_types: [{name: a, transport: {kafka: {topic: a.req}}}]\n", env(map[string]string{"DB_URL": "x"}))
	if err != nil {
		t.Fatal(err)
	}
	if e := none.Domain()["a"]; e.Events != (correlator.Events{}) || e.AllowedReplyTo != nil {
		t.Errorf("events without configuration: %+v, %v", e.Events, e.AllowedReplyTo)
	}
}

// TestEventsProblems: each bad events setting is named by its path.
func TestEventsProblems(t *testing.T) {
	_, err := Parse(minimal+`
intake: {topics: [jobs], dead_letter_topic: dl.jobs}
responses: {topics: [{topic: replies}]}
events: {on: [always], allowed_reply_to: ["a/b", "[", "job*", "*.req", "dl.*"]}
job_types:
  - name: a
    transport: {kafka: {topic: a.req}}
    events: {on: [final]}
  - name: b
    transport: {kafka: {topic: b.req}}
    events: {topic: "no spaces"}
  - name: c
    transport: {kafka: {topic: c.req}}
    events: {topic: replies}
`, env(map[string]string{"DB_URL": "x"}))
	var ce Errors
	if !errors.As(err, &ce) {
		t.Fatalf("got %v, want Errors", err)
	}
	for _, w := range []string{
		`events.on[0]: "always" is not one of [final attempt]`,
		"events.on: needs events.topic",
		"events.allowed_reply_to[0]:",
		"events.allowed_reply_to[1]:",
		`events.allowed_reply_to[2]: "job*" matches "jobs", one of hipq's inputs`,
		`events.allowed_reply_to[3]: "*.req" matches "a.req", which hipq writes to (job_types[0].transport.kafka.topic)`,
		`events.allowed_reply_to[4]: "dl.*" matches "dl.jobs", which hipq writes to (intake.dead_letter_topic)`,
		"job_types[0].events.topic: is required",
		"job_types[1].events.topic:",
		`job_types[2].events.topic: "replies" is one of hipq's inputs`,
	} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("missing %q in:\n%v", w, err)
		}
	}
}

// memory_limit takes bytes or a size with a unit; a bad one, or one below
// the minimum, is a problem naming it and why; left out, it stays unset
// (resolved at start) and the effective config does not show it.
func TestMemoryLimit(t *testing.T) {
	for text, want := range map[string]ByteSize{"64MiB": 64 << 20, "512MB": 512e6, "1GiB": 1 << 30, "67108864": 64 << 20,
		`"${LIMIT}"`: 96 << 20} {
		cfg, err := Parse(minimal+"memory_limit: "+text+"\n", env(map[string]string{"DB_URL": "x", "LIMIT": "96MiB"}))
		if err != nil || cfg.MemoryLimit != want {
			t.Errorf("memory_limit: %s: %v, %v; want %d", text, cfg, err, want)
			continue
		}
		if out := cfg.Redacted(); !strings.Contains(out, "memory_limit: ") {
			t.Errorf("memory_limit: %s: the effective config does not show it:\n%s", text, out)
		}
	}
	cfg, err := Parse(minimal, env(map[string]string{"DB_URL": "x"}))
	if err != nil || cfg.MemoryLimit != 0 || strings.Contains(cfg.Redacted(), "memory_limit") {
		t.Errorf("memory_limit left out: %v, %v", cfg, err)
	}
	if out := cfg.Redacted(); strings.Contains(out, "memory_limit") {
		t.Errorf("the effective config shows an unset memory_limit:\n%s", out)
	}
	for text, want := range map[string]string{
		"64 megabytes": `memory_limit: "64 megabytes" is not a size such as 64MiB, 512MB or 1GiB`,
		"16MiB":        "memory_limit: 16MiB is below the minimum of 32MiB",
		"0MiB":         "0 is no limit hipq takes",
		"-1":           `memory_limit: "-1" is not a size`,
		"[1]":          "memory_limit: not a size",
	} {
		_, err := Parse(minimal+"memory_limit: "+text+"\n", env(map[string]string{"DB_URL": "x"}))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("memory_limit: %s: %v, want %q", text, err, want)
		}
	}
}

// The effective config hides every secret of the database's connection
// string, in either form: the password and sslpassword, a quoted value
// whole (spaces and escaped quotes in it), nothing else.
func TestRedactConnectionStrings(t *testing.T) {
	for in, want := range map[string]string{
		"postgres://u:pw@h/db?sslmode=verify-full&sslpassword=hunter2&sslkey=/k": "postgres://u:" + hidden + "@h/db?sslkey=%2Fk&sslmode=verify-full&sslpassword=" + hidden,
		"postgres://h/db?password=pw":                                            "postgres://h/db?password=" + hidden,
		"host=h password=pw dbname=d":                                            "host=h password=" + hidden + " dbname=d",
		`host=h password='my secret\' tail' user=u`:                              "host=h password=" + hidden + " user=u",
		"host=h sslpassword = 'a b' sslkey=/k":                                   "host=h sslpassword = " + hidden + " sslkey=/k",
		"host=h user=password":                                                   "host=h user=password",
	} {
		got := redactURL(in)
		if got != want {
			t.Errorf("redactURL(%q) = %q, want %q", in, got, want)
		}
		for _, secret := range []string{"pw", "hunter2", "secret", "tail", "a b"} {
			if strings.Contains(strings.ReplaceAll(got, "password", ""), secret) && !strings.Contains(in, "user="+secret) {
				t.Errorf("redactURL(%q) = %q shows %q", in, got, secret)
			}
		}
	}
}

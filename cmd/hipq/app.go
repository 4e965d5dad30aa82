package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/hipq/hipq/api"
	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/consumer"
	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/activity"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/memlimit"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/tlsconf"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
	"github.com/hipq/hipq/sweeper"
)

// Roles a process can run.
var allRoles = []string{"intake", "dispatcher", "responses", "sweeper", "api"}

// app is one hipq process: the components its roles ask for, wired from
// the config.
type app struct {
	log        *zap.Logger
	st         *store.Store
	cfg        *config.Config
	types      correlator.Types
	kc         kafkaconn.Config
	matchers   map[string]correlator.Matcher // by response topic
	queues     []string
	crash      string // HIPQ_CRASHPOINT: tests' crash point
	intake     *consumer.Intake
	outbox     *consumer.Outbox
	responses  *consumer.Responses
	dispatcher *dispatcher.Dispatcher
	relay      *dispatcher.Relay // outcome events to Kafka, with the dispatcher role
	sweeper    *sweeper.Sweeper
	periodic   *sweeper.Periodic
	api        *api.Server
	activity   *activity.Recorder
	instance   string // this process's name in claims and activity
	producer   *kgo.Client
	producers  []*kgo.Client // of job types with a compression of their own
	kafkaPing  *kgo.Client   // readiness checks of the API
	apiStore   *store.Store  // the API's own connections
	metrics    *metrics.Metrics
	// probes listens on metrics.listen for /metrics, /healthz and /readyz
	// when the API does not serve them here; nil when it does.
	probes net.Listener
	// replyCopies copy the replies the dispatcher, sweeper and API
	// dead-letter to responses.dead_letter_topic.
	replyCopies *deadletter.Copier
	tracing     *tracing.Tracing
	// memory is what the buffers that follow a burst get of the memory
	// limit, and producerBytes each writing client's buffer of it.
	memory        memlimit.Split
	producerBytes int64
}

type appOptions struct {
	roles          []string
	metadataMinAge time.Duration // tests and the demo lower it
	// startTimeout, when set, bounds each start step but the migrations,
	// which run as long as they need (until ctx ends): building an index
	// CONCURRENTLY over a big table (migration 11) may outlast it, and cut
	// short it would start over at every restart.
	startTimeout time.Duration
	// memoryLimit is the resolved memory limit the buffers are drawn
	// from (hipq run applies it to the runtime too); 0: memlimit.Default.
	memoryLimit int64
}

func instanceName() string {
	host, _ := os.Hostname()
	if host == "" {
		host = "hipq"
	}
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return host + "-" + hex.EncodeToString(b)
}

func kafkaConfig(cfg *config.Config, minAge time.Duration) kafkaconn.Config {
	k := cfg.Kafka
	return kafkaconn.Config{Brokers: k.Brokers, ClientID: k.ClientID, TLS: k.TLS.Enabled, CAFile: cfg.Path(k.TLS.CAFile),
		ServerName: k.TLS.ServerName, CertFile: cfg.Path(k.TLS.CertFile), KeyFile: cfg.Path(k.TLS.KeyFile),
		SASLMechanism: k.SASL.Mechanism, Username: k.SASL.Username,
		Password: k.SASL.Password, MetadataMinAge: minAge, Compression: k.Compression}
}

// memorySplit is what the buffers get of limit: the split, and each
// writing client's buffer.
func memorySplit(cfg *config.Config, limit int64) (memlimit.Split, int64) {
	split := memlimit.SplitOf(limit)
	return split, split.ProducerBufferedBytes(writers(cfg), cfg.Kafka.MaxRecordBytes)
}

// writers counts the Kafka clients of a process that may write records:
// the requests' producer, one more per compression a job type has of its
// own, each consumer group's (its dead-letter copies), and the outcome
// events' relay when events are configured. Roles are left out: an
// instance that runs fewer buffers less.
func writers(cfg *config.Config) int {
	codecs := map[string]bool{}
	events := cfg.Events.Topic != "" || len(cfg.Events.AllowedReplyTo) > 0
	for _, jt := range cfg.JobTypes {
		if k := jt.Transport.Kafka; k != nil && k.Compression != "" && k.Compression != cfg.Kafka.Compression {
			codecs[k.Compression] = true
		}
		events = events || jt.Events != nil && jt.Events.Topic != ""
	}
	n := 3 + len(codecs)
	if events {
		n++
	}
	return n
}

// newApp opens the store (migrating when configured) and builds the
// components of the requested roles, one builder each.
func newApp(ctx context.Context, cfg *config.Config, log *zap.Logger, opts appOptions) (*app, error) {
	if len(opts.roles) == 0 {
		opts.roles = allRoles
	}
	bounded := func() (context.Context, context.CancelFunc) {
		if opts.startTimeout > 0 {
			return context.WithTimeout(ctx, opts.startTimeout)
		}
		return ctx, func() {}
	}
	openCtx, cancel := bounded()
	st, err := openStore(openCtx, cfg)
	cancel()
	if err != nil {
		return nil, err
	}
	if st.Distributed() {
		// On Citus one non-final job per (type, key) holds within a queue:
		// a type moved to another queue while it has non-final jobs could
		// have two. The start refuses, as check-config --database does.
		checkCtx, cancel := bounded()
		err := checkQueueMoves(checkCtx, cfg, st)
		cancel()
		if err != nil {
			st.Close()
			return nil, err
		}
	}
	domain := cfg.Domain()
	// Every statement that ends a job writes the outcome events the
	// config asks for (nothing when it asks for none).
	st = st.WithEvents(store.EventsOf(domain))
	a := &app{log: log, st: st, cfg: cfg, types: domain, metrics: metrics.New(), kc: kafkaConfig(cfg, opts.metadataMinAge),
		matchers: map[string]correlator.Matcher{}, crash: os.Getenv("HIPQ_CRASHPOINT"), instance: instanceName()}
	a.memory, a.producerBytes = memorySplit(cfg, cmp.Or(opts.memoryLimit, memlimit.Default))
	a.metrics.MemoryLimit.Set(float64(cmp.Or(opts.memoryLimit, memlimit.Default)))
	for _, q := range cfg.Queues {
		a.queues = append(a.queues, q.Name)
	}
	for i := range cfg.Responses.Topics {
		rt := &cfg.Responses.Topics[i]
		a.matchers[rt.Topic] = rt.Matcher(cfg.Intake.MaxBytes)
	}
	a.metrics.CountJobs(st.JobCounts, a.queues, 10*time.Second)
	has := func(r string) bool { return slices.Contains(opts.roles, r) }
	outbox := has("intake") && *cfg.Intake.Outbox
	migrateCtx, cancelMigrate := ctx, func() {}
	if !*cfg.Database.Migrate { // only a check: bounded like the other steps
		migrateCtx, cancelMigrate = bounded()
	}
	err = a.migrate(migrateCtx)
	cancelMigrate()
	if err != nil {
		a.close()
		return nil, err
	}
	steps := []func(context.Context) error{a.startTracing}
	if has("intake") {
		steps = append(steps, a.buildIntake)
	}
	if has("responses") {
		steps = append(steps, a.buildResponses)
	}
	if has("dispatcher") || has("sweeper") || has("api") || outbox {
		steps = append(steps, a.buildProducer)
	}
	if outbox {
		steps = append(steps, a.buildOutbox)
	}
	if has("dispatcher") {
		steps = append(steps, a.buildDispatcher)
	}
	if has("sweeper") {
		steps = append(steps, a.buildSweeper)
	}
	if has("api") {
		steps = append(steps, a.buildAPI)
	}
	steps = append(steps, a.buildProbes)
	for _, step := range steps {
		stepCtx, cancel := bounded()
		err := step(stepCtx)
		cancel()
		if err != nil {
			a.close()
			return nil, err
		}
	}
	// (On Citus no job is claimed as it is stored: the store stores them
	// waiting whatever it is asked, so the intake reserves nothing.)
	if a.intake != nil && a.dispatcher != nil && a.cfg.Dispatch.Grace.D() >= time.Second && !st.Distributed() {
		// Due jobs read here are claimed as they are stored, for this
		// instance's dispatcher to send: one write of the row, not two.
		// (A claim must be sent within grace/2 of its start, as HTTP
		// sends must: with less grace than a second, the dispatcher
		// claims them.)
		a.intake.ClaimFor(intakeClaims(a.dispatcher), a.instance)
	}
	if a.api == nil && slices.Equal(opts.roles, []string{"api"}) {
		a.close()
		return nil, errors.New("--only api: the config has no api section")
	}
	return a, nil
}

// migrate applies the migrations, or checks the schema is current when
// database.migrate is false.
func (a *app) migrate(ctx context.Context) error {
	if !*a.cfg.Database.Migrate {
		return a.st.CheckSchema(ctx)
	}
	applied, err := a.st.Migrate(ctx)
	for _, m := range applied {
		if m.Repeatable() {
			a.log.Info("repeatable migration applied", zap.String("name", m.Name), zap.String("checksum", m.Checksum()))
			continue
		}
		a.log.Info("migration applied", zap.Int("version", m.Version), zap.String("name", m.Name))
	}
	return err
}

// startTracing sets up OpenTelemetry from the tracing section and the
// OTEL_* environment; off, it costs nothing.
func (a *app) startTracing(ctx context.Context) error {
	t := a.cfg.Tracing
	if note := tracing.SamplerNote(t.Sampler); note != "" {
		a.log.Warn("tracing.sampler: a former hipq name, or a name whose meaning changed", zap.String("sampler", t.Sampler), zap.String("note", note))
	}
	var err error
	a.tracing, err = tracing.Start(ctx, tracing.Config{Endpoint: t.Endpoint, Sampler: t.Sampler, Ratio: t.Ratio,
		ServiceName: t.ServiceName, Name: a.cfg.Name, Link: t.Link, BatchTimeout: t.BatchTimeout.D()})
	if err == nil && a.tracing.Tracer != nil {
		a.log.Info("tracing on", zap.String("endpoint", t.Endpoint), zap.String("sampler", a.tracing.Sampler), zap.Bool("link", t.Link))
	}
	return err
}

// group is a consumer group's config from the config's kafka section,
// its fetches and buffer bounded by the memory limit's split.
func (a *app) group(name string, topics []string, start consumer.Start) consumer.GroupConfig {
	return consumer.GroupConfig{Kafka: a.kc, Group: name, Topics: topics, Start: start,
		SessionTimeout: a.cfg.Kafka.SessionTimeout.D(), Metrics: a.metrics, CrashPoint: a.crash, Tracer: a.tracing.Tracer,
		ReadUncommitted: a.cfg.Kafka.IsolationLevel == "read_uncommitted",
		FetchMaxBytes:   a.memory.FetchMaxBytes, FetchMaxPartitionBytes: a.memory.FetchMaxPartitionBytes,
		MaxConcurrentFetches: a.memory.MaxConcurrentFetches, MaxBufferedBytes: a.producerBytes,
		MaxDecompressBatchBytes: int(a.memory.MaxDecompressBatchBytes)}
}

// buildIntake: the intake consumer group, when intake.topics are set.
func (a *app) buildIntake(context.Context) error {
	in := a.cfg.Intake
	if len(in.Topics) == 0 {
		if !*in.Outbox {
			a.log.Warn("intake.topics is empty and intake.outbox is false: no intake runs")
		}
		return nil
	}
	var err error
	a.intake, err = consumer.NewIntake(a.log, a.st, consumer.IntakeConfig{GroupConfig: a.group(in.Group, in.Topics, in.Start),
		DeadLetterTopic: in.DeadLetterTopic, MaxBytes: in.MaxBytes, Types: a.types})
	return err
}

// buildResponses: the response consumer group, when responses.topics are
// set.
func (a *app) buildResponses(context.Context) error {
	rs := a.cfg.Responses
	if len(rs.Topics) == 0 {
		return nil
	}
	var topics []string
	for _, rt := range rs.Topics {
		topics = append(topics, rt.Topic)
	}
	var err error
	a.responses, err = consumer.NewResponses(a.log, a.st, consumer.ResponsesConfig{GroupConfig: a.group(rs.Group, topics, rs.Start),
		DeadLetterTopic: rs.DeadLetterTopic, EarlyTTL: rs.EarlyTTL.D(), Matchers: a.matchers, Types: a.types})
	return err
}

// buildProducer: the client that writes requests and the copies of the
// dead letters the sweeper, the API and the outbox write.
func (a *app) buildProducer(context.Context) error {
	var err error
	a.producer, err = a.newProducer(a.kc)
	a.replyCopies = &deadletter.Copier{Client: a.producer, Topic: a.cfg.Responses.DeadLetterTopic, Log: a.log}
	return err
}

// newProducer is a client that writes requests and dead-letter copies,
// its buffer of records not yet acknowledged bounded by its share of the
// memory limit: a send waits for room.
func (a *app) newProducer(kc kafkaconn.Config) (*kgo.Client, error) {
	return kafkaconn.NewClient(kc, a.log, append(dispatcher.KafkaProducerOpts(),
		kgo.ProducerBatchMaxBytes(int32(a.cfg.Kafka.MaxRecordBytes)), kgo.MaxBufferedBytes(int(a.producerBytes)))...)
}

// buildOutbox: the drainer of the transactional outbox.
func (a *app) buildOutbox(context.Context) error {
	a.outbox = consumer.NewOutbox(a.log, a.st, consumer.OutboxConfig{MaxBytes: a.cfg.Intake.MaxBytes, Types: a.types,
		Metrics: a.metrics, CrashPoint: a.crash, Tracer: a.tracing.Tracer,
		DeadLetters: &deadletter.Copier{Client: a.producer, Topic: a.cfg.Intake.DeadLetterTopic, Log: a.log}})
	return nil
}

// buildDispatcher: the transports of every job type, and the dispatcher
// over the queues.
func (a *app) buildDispatcher(ctx context.Context) error {
	cfg := a.cfg
	routes := map[string]dispatcher.KafkaRoute{}
	httpRoutes := map[string]dispatcher.HTTPRoute{}
	senders := map[string]dispatcher.Sender{}
	kafka := dispatcher.NewKafkaSender(a.producer, routes)
	hc := dispatcher.HTTPSenderConfig{Routes: httpRoutes, StartWithin: cfg.Dispatch.Grace.D() / 2, TracerProvider: a.tracing.Provider}
	if cfg.API != nil {
		hc.PublicURL, hc.CallbackSecret = cfg.API.PublicURL, []byte(cfg.API.CallbackSecret)
	}
	web := dispatcher.NewHTTPSender(hc)
	byCodec := map[string]*dispatcher.KafkaSender{}
	for _, jt := range cfg.JobTypes {
		switch {
		case jt.Transport.Kafka != nil:
			k := jt.Transport.Kafka
			routes[jt.Name] = dispatcher.KafkaRoute{Topic: k.Topic, Envelope: k.Envelope, ReplyTopic: jt.ReplyTopic}
			senders[jt.Name] = kafka
			if c := k.Compression; c != "" && c != cfg.Kafka.Compression {
				// Compression is a client's: a type with its own codec gets its own producer.
				if byCodec[c] == nil {
					pc := a.kc
					pc.Compression = c
					cl, err := a.newProducer(pc)
					if err != nil {
						return err
					}
					a.producers = append(a.producers, cl)
					byCodec[c] = dispatcher.NewKafkaSender(cl, routes)
				}
				senders[jt.Name] = byCodec[c]
			}
		case jt.Transport.HTTP != nil:
			h := jt.Transport.HTTP
			route := dispatcher.HTTPRoute{URL: h.URL, Method: h.Method, Headers: h.Headers,
				Timeout: h.Timeout.D(), Sync: h.Mode == dispatcher.HTTPSync, Delivery: jt.Delivery, MaxInFlight: h.MaxInFlight}
			if t := h.TLS; t != nil {
				log := a.log.With(zap.String("job_type", jt.Name))
				tc, err := tlsconf.Client(tlsconf.Files{CAFile: cfg.Path(t.CAFile), CertFile: cfg.Path(t.CertFile), KeyFile: cfg.Path(t.KeyFile),
					Reloaded: func(err error) {
						if err != nil {
							log.Warn("transport.http.tls: the changed client certificate cannot be read; sending the last good one", zap.Error(err))
						}
					}})
				if err != nil {
					return fmt.Errorf("job type %s: transport.http.tls.%w", jt.Name, err)
				}
				route.TLS = tc
			}
			httpRoutes[jt.Name] = route
			senders[jt.Name] = web
		}
	}
	var queues []dispatcher.QueueConfig
	throttles := cfg.Throttles()
	for _, q := range cfg.Queues {
		if t := throttles[q.Name]; t.Bounded() {
			a.log.Info("queue throttled", zap.String("queue", q.Name), zap.Int("throttle_limit", t.Limit),
				zap.Stringer("shares", t.Shares), zap.Strings("critical", t.Critical), zap.Any("max_concurrency", t.MaxConcurrency))
		}
		queues = append(queues, dispatcher.QueueConfig{Name: q.Name, Order: q.Order, Throttle: *throttles[q.Name]})
	}
	a.dispatcher = dispatcher.New(a.log, a.st, dispatcher.Config{Instance: a.instance, Interval: cfg.Dispatch.Interval.D(),
		BatchSize: cfg.Dispatch.BatchSize, Queues: queues, Types: a.types, Senders: senders, Metrics: a.metrics,
		DeadLetters: a.replyCopies, Tracer: a.tracing.Tracer, TraceLink: a.tracing.Link,
		IntakeClaimsFor: min(dispatcher.DefaultIntakeClaimsFor, cfg.Dispatch.Grace.D()/2)})
	// The relay holds a connection to listen, and its leader one for its
	// lock: it runs when events are configured, or written before a change
	// of the config wait.
	ev := store.EventsOf(a.types)
	var topics []string
	for _, r := range ev.Routes {
		if !slices.Contains(topics, r.Topic) {
			topics = append(topics, r.Topic)
		}
	}
	if !ev.On() {
		pending, err := a.st.EventsPending(ctx)
		if err != nil || len(pending) == 0 {
			return err
		}
	}
	// A producer of its own: events a topic holds back (retried until the
	// delivery timeout) fill only its buffer, never the requests'.
	relayProducer, err := a.newProducer(a.kc)
	if err != nil {
		return err
	}
	a.producers = append(a.producers, relayProducer)
	a.relay = dispatcher.NewRelay(a.log, a.st, relayProducer, dispatcher.RelayConfig{Interval: cfg.Dispatch.Interval.D(),
		BatchSize: cfg.Dispatch.BatchSize, Metrics: a.metrics, Topics: topics, CrashPoint: a.crash})
	return nil
}

// buildSweeper: the cron of timeouts, rescues, expiry and pruning.
func (a *app) buildSweeper(context.Context) error {
	sw := a.cfg.Sweeper
	a.sweeper = sweeper.New(a.log, a.st, sweeper.Config{Schedule: sw.Schedule, Retention: sw.Retention.D(),
		DeadLetterRetention: sw.DeadLetterRetention.D(), Grace: a.cfg.Dispatch.Grace.D(), Types: a.types,
		Metrics: a.metrics, DeadLetters: a.replyCopies, Tracer: a.tracing.Tracer})
	if s := a.cfg.PeriodicJobs(); len(s) > 0 {
		a.periodic = sweeper.NewPeriodic(a.log, a.st, s, a.types, a.metrics)
	}
	return nil
}

// buildAPI: the HTTP API, on connections of its own, when the config has
// an api section.
func (a *app) buildAPI(ctx context.Context) error {
	c := a.cfg.API
	if c == nil {
		return nil
	}
	var err error
	if a.kafkaPing, err = kafkaconn.NewClient(a.kc, a.log); err != nil {
		return err
	}
	// The API's own connections: bounded apart from the hot path's,
	// each statement bounded by the request timeout and planned for
	// its values.
	a.apiStore, err = store.Open(ctx, store.Config{URL: a.cfg.Database.URL, Schema: a.cfg.Database.Schema,
		MaxConns: int32(c.MaxConns), StatementTimeout: c.RequestTimeout.D(), CustomPlans: true, Citus: a.cfg.Database.Citus})
	if err != nil {
		return err
	}
	a.apiStore = a.apiStore.WithEvents(store.EventsOf(a.types)) // (a cancel ends a job)
	var ui *api.UIConfig
	if !c.UI.Disabled {
		ui = &api.UIConfig{PathPrefix: c.UI.PathPrefix, Redact: c.UI.Redact, Throttles: a.cfg.Throttles(), Lag: a.consumerLag,
			Requests: requestShapes(a.cfg), SecureCookies: strings.HasPrefix(c.PublicURL, "https:"), SessionTTL: c.UI.SessionTTL.D()}
	}
	var tc *tls.Config
	if t := c.TLS; t != nil {
		log := a.log.Named("api")
		tc, err = tlsconf.Server(tlsconf.Files{CertFile: a.cfg.Path(t.CertFile), KeyFile: a.cfg.Path(t.KeyFile), Reloaded: func(err error) {
			if err != nil {
				log.Warn("api.tls: the changed certificate cannot be read; serving the last good one", zap.Error(err))
				return
			}
			log.Info("api.tls: the changed certificate is served")
		}})
		if err != nil {
			return fmt.Errorf("api.tls.%w", err)
		}
	}
	a.api = api.New(a.log, a.apiStore, api.Config{Listen: c.Listen, TLS: tc, Tokens: c.Tokens, ReadTokens: c.ReadTokens, HotPath: a.st, UI: ui,
		RequestTimeout: c.RequestTimeout.D(), CallbackSecret: []byte(c.CallbackSecret), MaxBodyBytes: a.cfg.Intake.MaxBytes,
		Queues: a.queues, Types: a.types, Schedules: a.cfg.PeriodicJobs(), Matchers: a.matchers, EarlyTTL: a.cfg.Responses.EarlyTTL.D(), Ready: a.kafkaReady, Stalled: a.stalled,
		Metrics: a.metrics, DeadLetters: a.replyCopies, Tracer: a.tracing.Tracer, TracerProvider: a.tracing.Provider,
		Instance: a.instance})
	return nil
}

// buildProbes: /metrics, /healthz and /readyz on every instance. The API
// serves them on its listener; an instance without it serves them on
// metrics.listen (default :9464), as does one whose metrics.listen names
// another address than the API's.
func (a *app) buildProbes(context.Context) error {
	addr := a.cfg.Metrics.Listen
	if a.api != nil && (addr == "" || addr == a.cfg.API.Listen) {
		return nil
	}
	addr = cmp.Or(addr, config.DefaultMetricsListen)
	if a.kafkaPing == nil {
		var err error
		if a.kafkaPing, err = kafkaconn.NewClient(a.kc, a.log); err != nil {
			return err
		}
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics.listen: %w (another instance on this host? give each its own metrics.listen)", err)
	}
	a.probes = l
	return nil
}

// kafkaReady is readiness's Kafka check: nil once a broker answers, else
// each broker whose last connection failed and why (an untrusted
// certificate, a refused password), never the secret.
func (a *app) kafkaReady(ctx context.Context) error { return kafkaconn.Ping(ctx, a.kafkaPing) }

// stalled is nil while no consumer of this process waits on a refusal
// that is not its records' own, else what waits and why.
func (a *app) stalled() error {
	var errs []error
	if a.intake != nil {
		errs = append(errs, a.intake.Stalled())
	}
	if a.responses != nil {
		errs = append(errs, a.responses.Stalled())
	}
	if a.outbox != nil {
		errs = append(errs, a.outbox.Stalled())
	}
	return errors.Join(errs...)
}

// requestShapes describe each job type's requests for the dashboard,
// without secrets: header names only, URLs without query values.
func requestShapes(cfg *config.Config) map[string]api.RequestShape {
	out := map[string]api.RequestShape{}
	for _, jt := range cfg.JobTypes {
		switch t := jt.Transport; {
		case t.Kafka != nil:
			out[jt.Name] = api.RequestShape{Transport: "kafka", Target: t.Kafka.Topic, ReplyTopic: jt.ReplyTopic}
		case t.HTTP != nil:
			names := slices.Sorted(maps.Keys(t.HTTP.Headers))
			out[jt.Name] = api.RequestShape{Transport: "http", Headers: names,
				Target: cmp.Or(t.HTTP.Method, dispatcher.DefaultHTTPMethod) + " " + dispatcher.RedactURL(t.HTTP.URL)}
		}
	}
	return out
}

// consumerLag is, for the dashboard, each consumer group's records
// between the partitions' end offsets and the offsets stored in
// PostgreSQL: the lag of every instance at once.
func (a *app) consumerLag(ctx context.Context) ([]api.GroupLag, error) {
	offsets, err := a.st.OffsetsAll(ctx)
	if err != nil || len(offsets) == 0 {
		return nil, err
	}
	var topics []string
	for _, o := range offsets {
		if !slices.Contains(topics, o.Topic) {
			topics = append(topics, o.Topic)
		}
	}
	ends, err := kadm.NewClient(a.kafkaPing).ListEndOffsets(ctx, topics...)
	if err != nil {
		return nil, fmt.Errorf("list end offsets: %w", err)
	}
	var out []api.GroupLag
	for _, o := range offsets {
		end, ok := ends.Lookup(o.Topic, o.Partition)
		if !ok || end.Err != nil {
			continue
		}
		if n := len(out); n > 0 && out[n-1].Group == o.Group && out[n-1].Topic == o.Topic {
			out[n-1].Records += max(end.Offset-o.Next, 0)
			out[n-1].Partitions++
			continue
		}
		out = append(out, api.GroupLag{Group: o.Group, Topic: o.Topic, Partitions: 1, Records: max(end.Offset-o.Next, 0)})
	}
	return out, nil
}

// run runs every component until ctx ends; each drains what it started.
func (a *app) run(ctx context.Context) error {
	if a.intake == nil && a.outbox == nil && a.responses == nil && a.dispatcher == nil && a.sweeper == nil && a.api == nil {
		return errors.New("nothing to run: the roles asked for have nothing configured (intake.topics or intake.outbox, responses.topics)")
	}
	g, ctx := errgroup.WithContext(ctx)
	if a.intake != nil {
		g.Go(func() error { return a.intake.Run(ctx) })
	}
	if a.outbox != nil {
		g.Go(func() error { return a.outbox.Run(ctx) })
	}
	if a.responses != nil {
		g.Go(func() error { return a.responses.Run(ctx) })
	}
	if a.dispatcher != nil {
		g.Go(func() error { return a.dispatcher.Run(ctx) })
	}
	if a.relay != nil {
		g.Go(func() error { return a.relay.Run(ctx) })
	}
	if a.sweeper != nil {
		g.Go(func() error { return a.sweeper.Run(ctx) })
	}
	if a.periodic != nil {
		g.Go(func() error { return a.periodic.Run(ctx) })
	}
	if a.api != nil {
		g.Go(func() error { return a.api.Run(ctx) })
	}
	if a.probes != nil {
		a.log.Info("metrics listening", zap.String("addr", a.probes.Addr().String()))
		g.Go(func() error {
			return api.ServeProbes(ctx, a.log, a.probes, api.ProbeConfig{Store: a.st, Ready: a.kafkaReady, Stalled: a.stalled, Metrics: a.metrics})
		})
	}
	a.activity = activity.New(a.log, a.st, a.metrics, a.instance, a.types, 0)
	g.Go(func() error { return a.activity.Run(ctx) })
	g.Go(func() error { a.watchStats(ctx, 250*time.Millisecond); return nil })
	a.log.Info("hipq running", zap.String("name", a.cfg.Name), zap.Bool("intake", a.intake != nil), zap.Bool("outbox", a.outbox != nil),
		zap.Bool("dispatcher", a.dispatcher != nil), zap.Bool("responses", a.responses != nil), zap.Bool("sweeper", a.sweeper != nil), zap.Bool("api", a.api != nil))
	err := g.Wait()
	for _, p := range append([]*kgo.Client{a.producer}, a.producers...) {
		if p != nil {
			p.Flush(context.Background())
		}
	}
	return err
}

// watchStats keeps the statistics of the hot tables up with their growth
// (store.StatsRefresh), so that no plan made on a nearly empty table
// outlives it by autovacuum's minute. A failure is logged once a minute at
// most: the database being away is reported by whatever needs it. Four
// times a second: the check is a catalog read, and a burst into an empty
// table must not run long on its first plans.
func (a *app) watchStats(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	var warned time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		tables, err := a.st.StatsRefresh(ctx)
		switch {
		case err != nil && ctx.Err() == nil && time.Since(warned) > time.Minute:
			warned = time.Now()
			a.log.Warn("cannot refresh the statistics of hipq's tables (plans may lag their growth)", zap.Error(err))
		case len(tables) > 0:
			a.log.Debug("analyzed tables that doubled in size", zap.Strings("tables", tables))
		}
	}
}

func (a *app) close() {
	if a.tracing != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := a.tracing.Shutdown(ctx); err != nil {
			a.log.Warn("spans not exported at shutdown", zap.Error(err))
		}
		cancel()
	}
	if a.producer != nil {
		a.producer.Close()
	}
	for _, p := range a.producers {
		p.Close()
	}
	if a.kafkaPing != nil {
		a.kafkaPing.Close()
	}
	if a.probes != nil {
		a.probes.Close() // (already closed when run served it)
	}
	if a.apiStore != nil {
		a.apiStore.Close()
	}
	a.st.Close()
}

func parseRoles(s string) ([]string, error) {
	if s == "" {
		return allRoles, nil
	}
	var out []string
	for _, r := range splitComma(s) {
		if !slices.Contains(allRoles, r) {
			return nil, fmt.Errorf("--only: unknown role %q (roles: intake, dispatcher, responses, sweeper, api)", r)
		}
		out = append(out, r)
	}
	return out, nil
}

// intakeClaims is the seam between the intake and this instance's
// dispatcher: the roles never call each other, cmd wires one to the other.
func intakeClaims(d *dispatcher.Dispatcher) consumer.Claimer {
	return consumer.ClaimerFunc(func(queue string, jobTypes []string) consumer.Reservation {
		if r := d.Reserve(queue, jobTypes); r != nil {
			return r
		}
		return nil // (never a nil *dispatcher.Reservation in the interface)
	})
}

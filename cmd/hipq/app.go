package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/hipq/hipq/api"
	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/consumer"
	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/metrics"
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
	intake     *consumer.Intake
	outbox     *consumer.Outbox
	responses  *consumer.Responses
	dispatcher *dispatcher.Dispatcher
	sweeper    *sweeper.Sweeper
	api        *api.Server
	producer   *kgo.Client
	producers  []*kgo.Client // of job types with a compression of their own
	kafkaPing  *kgo.Client   // readiness checks of the API
	apiStore   *store.Store  // the API's own connections
	metrics    *metrics.Metrics
}

type appOptions struct {
	roles          []string
	metadataMinAge time.Duration // tests and the demo lower it
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
	return kafkaconn.Config{Brokers: k.Brokers, ClientID: k.ClientID, TLS: k.TLS.Enabled, CAFile: k.TLS.CAFile,
		CertFile: k.TLS.CertFile, KeyFile: k.TLS.KeyFile, SASLMechanism: k.SASL.Mechanism, Username: k.SASL.Username,
		Password: k.SASL.Password, MetadataMinAge: minAge, Compression: k.Compression}
}

// newApp opens the store (migrating when configured) and builds the
// components of the requested roles.
func newApp(ctx context.Context, cfg *config.Config, log *zap.Logger, opts appOptions) (*app, error) {
	if len(opts.roles) == 0 {
		opts.roles = allRoles
	}
	st, err := openStore(ctx, cfg)
	if err != nil {
		return nil, err
	}
	a := &app{log: log, st: st, cfg: cfg, types: cfg.Domain(), metrics: metrics.New()}
	var queueNames []string
	for _, q := range cfg.Queues {
		queueNames = append(queueNames, q.Name)
	}
	a.metrics.CountJobs(st.JobCounts, queueNames, 10*time.Second)
	fail := func(err error) (*app, error) {
		a.close()
		return nil, err
	}
	if *cfg.Database.Migrate {
		applied, err := st.Migrate(ctx)
		if err != nil {
			return fail(err)
		}
		for _, m := range applied {
			log.Info("migration applied", zap.Int("version", m.Version), zap.String("name", m.Name))
		}
	} else if err := st.CheckSchema(ctx); err != nil {
		return fail(err)
	}
	kc := kafkaConfig(cfg, opts.metadataMinAge)
	has := func(r string) bool { return slices.Contains(opts.roles, r) }
	instance := instanceName()
	if has("intake") && len(cfg.Intake.Topics) > 0 {
		a.intake, err = consumer.NewIntake(log, st, consumer.IntakeConfig{
			GroupConfig: consumer.GroupConfig{Kafka: kc, Group: cfg.Intake.Group, Topics: cfg.Intake.Topics,
				Start: cfg.Intake.Start, SessionTimeout: cfg.Kafka.SessionTimeout.D(), Metrics: a.metrics,
				ReadUncommitted: cfg.Kafka.IsolationLevel == "read_uncommitted"},
			DeadLetterTopic: cfg.Intake.DeadLetterTopic, MaxBytes: cfg.Intake.MaxBytes, Types: a.types})
		if err != nil {
			return fail(err)
		}
	} else if has("intake") && !*cfg.Intake.Outbox {
		log.Warn("intake.topics is empty and intake.outbox is false: no intake runs")
	}
	matchers := map[string]correlator.Matcher{}
	var topics []string
	for i := range cfg.Responses.Topics {
		rt := &cfg.Responses.Topics[i]
		matchers[rt.Topic] = rt.Matcher(cfg.Intake.MaxBytes)
		topics = append(topics, rt.Topic)
	}
	if has("responses") && len(cfg.Responses.Topics) > 0 {
		a.responses, err = consumer.NewResponses(log, st, consumer.ResponsesConfig{
			GroupConfig: consumer.GroupConfig{Kafka: kc, Group: cfg.Responses.Group, Topics: topics,
				Start: cfg.Responses.Start, SessionTimeout: cfg.Kafka.SessionTimeout.D(), Metrics: a.metrics,
				ReadUncommitted: cfg.Kafka.IsolationLevel == "read_uncommitted"},
			DeadLetterTopic: cfg.Responses.DeadLetterTopic, EarlyTTL: cfg.Responses.EarlyTTL.D(),
			Matchers: matchers, Types: a.types})
		if err != nil {
			return fail(err)
		}
	}
	outbox := has("intake") && *cfg.Intake.Outbox
	if has("dispatcher") || has("sweeper") || has("api") || outbox {
		// Requests, and copies of the dead letters the sweeper, the API
		// and the outbox write.
		a.producer, err = kafkaconn.NewClient(kc, log, append(dispatcher.KafkaProducerOpts(),
			kgo.ProducerBatchMaxBytes(int32(cfg.Kafka.MaxRecordBytes)))...)
		if err != nil {
			return fail(err)
		}
	}
	replyCopies := &deadletter.Copier{Client: a.producer, Topic: cfg.Responses.DeadLetterTopic, Log: log}
	if outbox {
		a.outbox = consumer.NewOutbox(log, st, consumer.OutboxConfig{MaxBytes: cfg.Intake.MaxBytes, Types: a.types,
			Metrics: a.metrics, DeadLetters: &deadletter.Copier{Client: a.producer, Topic: cfg.Intake.DeadLetterTopic, Log: log}})
	}
	if has("dispatcher") {
		routes := map[string]dispatcher.KafkaRoute{}
		httpRoutes := map[string]dispatcher.HTTPRoute{}
		senders := map[string]dispatcher.Sender{}
		kafka := dispatcher.NewKafkaSender(a.producer, routes)
		hc := dispatcher.HTTPSenderConfig{Routes: httpRoutes, StartWithin: cfg.Dispatch.Grace.D() / 2}
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
						pc := kc
						pc.Compression = c
						cl, err := kafkaconn.NewClient(pc, log, append(dispatcher.KafkaProducerOpts(),
							kgo.ProducerBatchMaxBytes(int32(cfg.Kafka.MaxRecordBytes)))...)
						if err != nil {
							return fail(err)
						}
						a.producers = append(a.producers, cl)
						byCodec[c] = dispatcher.NewKafkaSender(cl, routes)
					}
					senders[jt.Name] = byCodec[c]
				}
			case jt.Transport.HTTP != nil:
				h := jt.Transport.HTTP
				httpRoutes[jt.Name] = dispatcher.HTTPRoute{URL: h.URL, Method: h.Method, Headers: h.Headers,
					Timeout: h.Timeout.D(), Sync: h.Mode == dispatcher.HTTPSync, Delivery: jt.Delivery, MaxInFlight: h.MaxInFlight}
				senders[jt.Name] = web
			}
		}
		var queues []dispatcher.QueueConfig
		throttles := cfg.Throttles()
		for _, q := range cfg.Queues {
			if t := throttles[q.Name]; t.Bounded() {
				log.Info("queue throttled", zap.String("queue", q.Name), zap.Int("throttle_limit", t.Limit),
					zap.Stringer("shares", t.Shares), zap.Strings("critical", t.Critical), zap.Any("max_concurrency", t.MaxConcurrency))
			}
			queues = append(queues, dispatcher.QueueConfig{Name: q.Name, Order: q.Order, Throttle: *throttles[q.Name]})
		}
		a.dispatcher = dispatcher.New(log, st, dispatcher.Config{Instance: instance, Interval: cfg.Dispatch.Interval.D(),
			BatchSize: cfg.Dispatch.BatchSize, Queues: queues, Types: a.types, Senders: senders, Metrics: a.metrics,
			DeadLetters: replyCopies})
	}
	if has("sweeper") {
		a.sweeper = sweeper.New(log, st, sweeper.Config{Schedule: cfg.Sweeper.Schedule, Retention: cfg.Sweeper.Retention.D(),
			DeadLetterRetention: cfg.Sweeper.DeadLetterRetention.D(), Grace: cfg.Dispatch.Grace.D(), Types: a.types,
			Metrics: a.metrics, DeadLetters: replyCopies})
	}
	if has("api") && cfg.API != nil {
		a.kafkaPing, err = kafkaconn.NewClient(kc, log)
		if err != nil {
			return fail(err)
		}
		// The API's own connections: bounded apart from the hot path's,
		// each statement bounded by the request timeout and planned for
		// its values.
		a.apiStore, err = store.Open(ctx, store.Config{URL: cfg.Database.URL, Schema: cfg.Database.Schema,
			MaxConns: int32(cfg.API.MaxConns), StatementTimeout: cfg.API.RequestTimeout.D(), CustomPlans: true})
		if err != nil {
			return fail(err)
		}
		a.api = api.New(log, a.apiStore, api.Config{Listen: cfg.API.Listen, Tokens: cfg.API.Tokens, HotPath: st,
			RequestTimeout: cfg.API.RequestTimeout.D(),
			CallbackSecret: []byte(cfg.API.CallbackSecret), MaxBodyBytes: cfg.Intake.MaxBytes, Queues: queueNames,
			Types: a.types, Matchers: matchers, EarlyTTL: cfg.Responses.EarlyTTL.D(), Ready: a.kafkaPing.Ping,
			Metrics: a.metrics, DeadLetters: replyCopies})
	} else if slices.Equal(opts.roles, []string{"api"}) {
		return fail(errors.New("--only api: the config has no api section"))
	}
	return a, nil
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
	if a.sweeper != nil {
		g.Go(func() error { return a.sweeper.Run(ctx) })
	}
	if a.api != nil {
		g.Go(func() error { return a.api.Run(ctx) })
	}
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

func (a *app) close() {
	if a.producer != nil {
		a.producer.Close()
	}
	for _, p := range a.producers {
		p.Close()
	}
	if a.kafkaPing != nil {
		a.kafkaPing.Close()
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

package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/config"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
)

// TestMain doubles as `hipq` for the crash tests: with HIPQ_TEST_MAIN set
// the test binary runs the command line in it instead of the tests.
func TestMain(m *testing.M) {
	if args := os.Getenv("HIPQ_TEST_MAIN"); args != "" {
		os.Exit(runMain(strings.Fields(args), os.Stdout, os.Stderr))
	}
	pgtest.Main(m)
}

// env is one test's Kafka, database and config text.
type env struct {
	t     *testing.T
	kafka *kafkatest.Cluster
	dbURL string
	db    *pgxpool.Pool // pool's, made on first use
}

func newEnv(t *testing.T, topics ...string) *env {
	t.Helper()
	return newEnvWith(t, kafkatest.New(t), topics...)
}

func newEnvWith(t *testing.T, k *kafkatest.Cluster, topics ...string) *env {
	t.Helper()
	e := &env{t: t, kafka: k, dbURL: pgtest.URL(t)}
	var names []string
	for _, tp := range topics {
		names = append(names, e.kafka.Topic(tp))
	}
	e.kafka.CreateTopics(2, names...)
	return e
}

// config renders text: {{DB}}, {{BROKERS}} and {{T:name}} for topic names.
// Every instance serves /metrics on metrics.listen (:9464 by default
// without the API): unless the text says where, each gets a free loopback
// port of its own.
func (e *env) configText(text string) string {
	if !strings.Contains(text, "metrics:") && !strings.HasPrefix(strings.TrimSpace(text), "{") {
		text += "\nmetrics: {listen: \"127.0.0.1:0\"}\n"
	}
	r := []string{"{{DB}}", e.dbURL, "{{BROKERS}}", strings.Join(e.kafka.Brokers, ",")}
	for _, f := range strings.Split(text, "{{T:")[1:] {
		name, _, _ := strings.Cut(f, "}}")
		r = append(r, "{{T:"+name+"}}", e.kafka.Topic(name))
	}
	return strings.NewReplacer(r...).Replace(text)
}

func (e *env) config(text string) *config.Config {
	e.t.Helper()
	cfg, err := config.Parse(e.configText(text), nil)
	if err != nil {
		e.t.Fatal(err)
	}
	return cfg
}

// start runs an app until the test ends.
func (e *env) start(cfg *config.Config, roles ...string) *app {
	e.t.Helper()
	a, _ := e.startStoppable(cfg, roles...)
	return a
}

func (e *env) countJobs(a *app, where string) int {
	e.t.Helper()
	var n int
	if err := a.st.Pool().QueryRow(context.Background(), "SELECT count(*) FROM hipq_job WHERE "+where).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *env) produce(topic string, values ...string) {
	e.t.Helper()
	var rs []*kgo.Record
	for _, v := range values {
		rs = append(rs, &kgo.Record{Topic: e.kafka.Topic(topic), Value: []byte(v)})
	}
	e.kafka.Produce(rs...)
}

// respond answers requests on topic like a downstream: decide says what.
func (e *env) respond(ctx context.Context, requests, replies string, decide func(key string, attempt int) (string, bool)) {
	e.respondAfter(ctx, requests, replies, nil, decide)
}

// respondAfter is respond with each reply sent delay() after its request.
func (e *env) respondAfter(ctx context.Context, requests, replies string, delay func() time.Duration,
	decide func(key string, attempt int) (string, bool)) {
	r, err := newResponder(e.kafka.Brokers, "responder-"+e.kafka.Topic(requests), e.kafka.Topic(requests), e.kafka.Topic(replies), decide,
		e.kafka.ClientOpts()...)
	if err != nil {
		e.t.Fatal(err)
	}
	r.delay = delay
	go r.run(ctx)
}

// withAPI adds an api section (listening on a free loopback port, with
// extra keys) to config text; it returns the text and the API's URL.
func withAPI(t *testing.T, text, extra string) (string, string) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return strings.Replace(text, "sweeper:", fmt.Sprintf(`api: {listen: "%s", callback_secret: "%s"%s}
sweeper:`, addr, strings.Repeat("S", 32), extra), 1), "http://" + addr
}

// waitAPI waits until the API at url answers.
func waitAPI(t *testing.T, url string) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		resp, err := http.Get(url + "/healthz")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return true, ""
	}, "the API")
}

func jobReq(key string) string {
	return fmt.Sprintf(`{"job_type":"e2e","job_key":%q,"job_data":{"key":%q}}`, key, key)
}

var _ = correlator.StateFinal

func nopLogger() *zap.Logger { return zap.NewNop() }

// scrape reads the metrics h serves, in the Prometheus text format, as
// series (name{labels} as printed) to values.
func scrape(t *testing.T, h http.Handler) map[string]float64 {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("/metrics answered %d: %s", rec.Code, rec.Body)
	}
	return parseMetrics(t, rec.Body.String())
}

func parseMetrics(t *testing.T, text string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, line := range strings.Split(text, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if i < 0 || err != nil {
			t.Fatalf("metrics line %q", line)
		}
		out[line[:i]] = v
	}
	return out
}

// wantMetrics fails for each series whose value is not the wanted one.
func wantMetrics(t *testing.T, got map[string]float64, want map[string]float64) {
	t.Helper()
	for series, v := range want {
		if g, ok := got[series]; !ok || g != v {
			t.Errorf("%s = %v (present: %v), want %v", series, g, ok, v)
		}
	}
}

// Package pgtest gives each test its own freshly migrated database on a
// real PostgreSQL: a private throwaway cluster per test binary (see
// localpg), the server at HIPQ_TEST_DATABASE_URL when set, or, with
// HIPQ_TEST_DOCKER=1 and the tests built with -tags docker, a testcontainers
// PostgreSQL (tests skip, saying why, when Docker is not there). Databases
// are copied from a migrated template, so tests can run in parallel.
package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/hipq/hipq/internal/citustest"
	"github.com/hipq/hipq/internal/localpg"
	"github.com/hipq/hipq/store"
)

var (
	once     sync.Once
	cluster  *localpg.Cluster
	adminURL string // a URL to the server's maintenance database
	setupErr error
	skipWhy  string // set when containers were asked for but cannot run
	stopDB   func()
	mu       sync.Mutex // CREATE DATABASE from one template, one at a time
	seq      atomic.Int64
	prefix   = fmt.Sprintf("hipq_t%d_", os.Getpid())
)

// Main runs the tests, stops the cluster (and the Citus cluster of
// citustest, when a test started it), and then fails the run if a
// goroutine is still running that the tests started (goleak): a test
// must stop what it starts. opts are for goroutines a package knows to
// outlive its tests. Use it from TestMain.
func Main(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	if cluster != nil {
		cluster.Stop()
	}
	if stopDB != nil {
		stopDB()
	}
	citustest.Stop()
	if code == 0 {
		if err := goleak.Find(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: goroutines left running after the tests passed: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// startContainer starts a PostgreSQL container; docker.go sets it in
// builds with -tags docker.
var startContainer func(context.Context) (url string, stop func(), err error)

var errNoDocker = errors.New("no Docker engine is reachable")

// OnCitus says whether the tests run on a Citus cluster
// (HIPQ_TEST_CITUS=1, make test-citus).
func OnCitus() bool { return citustest.Enabled() }

// WorkerURL returns the URL of the database url names (one of URL's, on
// the Citus cluster) on the cluster's first worker node, or skips t when
// the tests do not run on Citus.
func WorkerURL(t testing.TB, url string) string {
	t.Helper()
	if !OnCitus() {
		t.Skip("needs a Citus cluster: make test-citus runs it")
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	ws := citustest.WorkerURLs(cfg.Database)
	if len(ws) == 0 {
		t.Fatal("the Citus cluster has no worker")
	}
	return ws[0]
}

// PendingEventsSQL is a query of the number of outcome events pending, of
// topic (all topics when ""): the rows of hipq_event, and on one
// PostgreSQL the jobs' final events read from the jobs above their
// topic's cursor (which an idle relay brings to the last event it sent).
func PendingEventsSQL(topic string) string {
	rows, jobs := "", ""
	if topic != "" {
		rows, jobs = " WHERE topic = '"+topic+"'", " AND j.event_topic = '"+topic+"'"
	}
	if OnCitus() {
		return "SELECT count(*) FROM hipq_event" + rows
	}
	return "SELECT (SELECT count(*) FROM hipq_event" + rows + ") + (SELECT count(*) FROM hipq_job j WHERE j.event_id IS NOT NULL" + jobs +
		" AND j.event_id > coalesce((SELECT c.after FROM hipq_event_cursor c WHERE c.topic = j.event_topic), 0))"
}

// SkipOnCitus skips t when the tests run on Citus, for the reason why:
// what t holds is not hipq's behaviour there.
func SkipOnCitus(t testing.TB, why string) {
	t.Helper()
	if OnCitus() {
		t.Skip("on Citus, " + why)
	}
}

func setup() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if OnCitus() {
		setupCitus(ctx)
		return
	}
	if u := os.Getenv("HIPQ_TEST_DATABASE_URL"); u != "" {
		adminURL = u
	} else if os.Getenv("HIPQ_TEST_DOCKER") == "1" {
		if startContainer == nil {
			skipWhy = "HIPQ_TEST_DOCKER=1 asks for a PostgreSQL container: build the tests with -tags docker"
			return
		}
		adminURL, stopDB, setupErr = startContainer(ctx)
		if errors.Is(setupErr, errNoDocker) {
			skipWhy = "HIPQ_TEST_DOCKER=1 asks for a PostgreSQL container, but " + setupErr.Error()
			setupErr = nil
			return
		}
		if setupErr != nil {
			return
		}
	} else {
		cluster, setupErr = localpg.Start(ctx, localpg.Options{})
		if setupErr != nil {
			return
		}
		adminURL = cluster.URL("postgres")
	}
	tmpl := prefix + "template"
	if setupErr = createDB(ctx, tmpl, ""); setupErr != nil {
		return
	}
	s, err := store.Open(ctx, store.Config{URL: withDB(tmpl), MaxConns: 2})
	if err != nil {
		setupErr = err
		return
	}
	defer s.Close()
	_, setupErr = s.Migrate(ctx)
}

// setupCitus makes the template of the tests' databases on the Citus
// cluster of citustest: migrated, so laid out for Citus, then frozen.
func setupCitus(ctx context.Context) {
	if err := citustest.Start(); errors.Is(err, citustest.ErrSkip) {
		skipWhy = "HIPQ_TEST_CITUS=1 asks for a Citus cluster, but " + err.Error()
		return
	} else if err != nil {
		setupErr = err
		return
	}
	tmpl := prefix + "template"
	u, err := citustest.NewDatabase(ctx, tmpl, "")
	if err != nil {
		setupErr = err
		return
	}
	s, err := store.Open(ctx, store.Config{URL: u, MaxConns: 2, Citus: store.CitusOn})
	if err != nil {
		setupErr = err
		return
	}
	_, setupErr = s.Migrate(ctx)
	s.Close()
	if setupErr == nil {
		setupErr = citustest.Freeze(ctx, tmpl)
	}
}

func createDB(ctx context.Context, name, from string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("connect to test server: %w", err)
	}
	defer conn.Close(ctx)
	q := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if from != "" {
		q += " TEMPLATE " + pgx.Identifier{from}.Sanitize()
	}
	_, err = conn.Exec(ctx, q)
	return err
}

func dropDB(ctx context.Context, name string) {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
}

func withDB(name string) string {
	cfg, err := pgx.ParseConfig(adminURL)
	if err != nil {
		return adminURL
	}
	if cfg.Host != "" && cfg.Host[0] == '/' {
		return fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, name)
	}
	return fmt.Sprintf("host=%s port=%d user=%s password=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, cfg.Password, name)
}

// URL returns the URL of a new migrated database for t, dropped when t ends.
func URL(t testing.TB) string {
	t.Helper()
	once.Do(setup)
	if skipWhy != "" {
		t.Skip(skipWhy)
	}
	if setupErr != nil {
		t.Fatalf("test PostgreSQL: %v", setupErr)
	}
	name := fmt.Sprintf("%s%d", prefix, seq.Add(1))
	ctx := context.Background()
	if OnCitus() {
		mu.Lock()
		u, err := citustest.NewDatabase(ctx, name, prefix+"template")
		mu.Unlock()
		if err != nil {
			t.Fatalf("create Citus test database: %v", err)
		}
		return u
	}
	mu.Lock()
	err := createDB(ctx, name, prefix+"template")
	mu.Unlock()
	if err != nil {
		t.Fatalf("create test database: %v", err)
	}
	t.Cleanup(func() {
		if os.Getenv("HIPQ_TEST_DATABASE_URL") != "" {
			dropDB(context.Background(), name)
		}
	})
	return withDB(name)
}

// New returns a store on a new migrated database for t.
func New(t testing.TB) *store.Store {
	t.Helper()
	s, err := store.Open(context.Background(), store.Config{URL: URL(t), MaxConns: 8})
	if err != nil {
		t.Fatalf("open test store: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

// Package citustest gives tests a database on a real Citus cluster: a
// coordinator and Workers workers, each a private throwaway PostgreSQL
// (localpg) listening on 127.0.0.1 with the citus extension preloaded,
// started once per test binary at the first test that asks. Each test
// gets a database of its own, created on every node with the extension and
// the workers added to the coordinator's metadata, so each is a Citus
// cluster of its own; it is not migrated.
//
// Tests skip, saying why, on a machine where Citus is not installed beside
// PostgreSQL (no citus.control in its extension directory).
package citustest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/internal/localpg"
)

// Enabled says whether the tests are to run on a Citus cluster
// (HIPQ_TEST_CITUS=1, as make test-citus sets). pgtest.OnCitus says the
// same; package store's own tests, which pgtest cannot serve (it imports
// store), ask here.
func Enabled() bool { return os.Getenv("HIPQ_TEST_CITUS") == "1" }

// Workers is the number of worker nodes beside the coordinator.
const Workers = 2

var (
	once     sync.Once
	nodes    []*localpg.Cluster // the coordinator first
	skipWhy  string
	setupErr error
	seq      atomic.Int64
	prefix   = fmt.Sprintf("hipq_c%d_", os.Getpid())
)

// Installed reports whether Citus is installed beside the PostgreSQL
// localpg runs, and if not, where it looked.
func Installed() (bool, string) {
	bin, err := localpg.BinDir()
	if err != nil {
		return false, err.Error()
	}
	// Debian: /usr/lib/postgresql/NN/bin and /usr/share/postgresql/NN;
	// a build from source: PREFIX/bin and PREFIX/share[/postgresql].
	ver := filepath.Base(filepath.Dir(bin))
	candidates := []string{
		filepath.Join("/usr/share/postgresql", ver, "extension", "citus.control"),
		filepath.Join(bin, "..", "share", "postgresql", "extension", "citus.control"),
		filepath.Join(bin, "..", "share", "extension", "citus.control"),
	}
	for _, c := range candidates {
		if _, err := os.Stat(c); err == nil {
			return true, ""
		}
	}
	return false, fmt.Sprintf("Citus is not installed beside the PostgreSQL in %s (no citus.control at %v): these tests need a Citus cluster", bin, candidates)
}

func setup() {
	ok, why := Installed()
	if !ok {
		skipWhy = why
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for range 1 + Workers {
		c, err := localpg.Start(ctx, localpg.Options{TCP: true, Settings: map[string]string{
			"shared_preload_libraries": "citus",
			// Citus commits a transaction that wrote on several nodes in
			// two phases.
			"max_prepared_transactions": "200",
			// The nodes talk over 127.0.0.1 without TLS (libpq would
			// otherwise look for client certificates in the home
			// directory of whoever started the tests).
			"citus.node_conninfo": "sslmode=disable",
		}})
		if err != nil {
			if e := err.Error(); strings.Contains(e, "could not load library") && strings.Contains(e, "citus") {
				// Installed, but built for another PostgreSQL than this one:
				// the machine's setup, not hipq's code, so the tests skip.
				skipWhy = "Citus is installed but does not load into this PostgreSQL (built for another release of it): " +
					firstLine(e, "could not load library") + ": these tests need a Citus that loads"
				Stop()
				return
			}
			setupErr = fmt.Errorf("start a Citus node: %w", err)
			return
		}
		nodes = append(nodes, c)
	}
}

// Stop stops the cluster, if a test started it. pgtest.Main calls it.
func Stop() {
	for _, c := range nodes {
		c.Stop()
	}
	nodes = nil
}

// URL returns the URL of a new database on the coordinator of the test
// binary's Citus cluster, with the citus extension created on every node
// and the workers added, or skips t where Citus is not installed.
func URL(t testing.TB) string {
	t.Helper()
	Require(t)
	name := fmt.Sprintf("%s%d", prefix, seq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	u, err := NewDatabase(ctx, name, "")
	if err != nil {
		t.Fatalf("create Citus test database: %v", err)
	}
	return u
}

// Require starts the test binary's Citus cluster at its first call, and
// skips t, saying why, where Citus is not installed.
func Require(t testing.TB) {
	t.Helper()
	if err := Start(); errors.Is(err, ErrSkip) {
		t.Skip(err.Error())
	} else if err != nil {
		t.Fatalf("test Citus cluster: %v", err)
	}
}

// ErrSkip wraps why the Citus tests cannot run on this machine (Citus is
// not installed beside PostgreSQL, or does not load into it).
var ErrSkip = errors.New("no Citus here")

// Start starts the test binary's Citus cluster at its first call; it
// returns an error wrapping ErrSkip where Citus is not installed.
func Start() error {
	once.Do(setup)
	if skipWhy != "" {
		return fmt.Errorf("%w: %s", ErrSkip, skipWhy)
	}
	return setupErr
}

// NewDatabase creates database name on every node of the started cluster
// and returns its URL on the coordinator. Without a template, it creates
// the citus extension on every node and adds the workers to the
// coordinator's metadata of it. With one (a database Freeze made
// read-only, of every node), each node copies its own: the copy is the
// same cluster, metadata, shards and rows, under another name (Citus
// reaches a database's shards on the workers by the database's name).
func NewDatabase(ctx context.Context, name, template string) (string, error) {
	if len(nodes) == 0 {
		return "", errors.New("citustest: the cluster is not started")
	}
	for _, n := range nodes {
		u, err := n.CreateDatabase(ctx, name, template)
		if err != nil {
			return "", err
		}
		if template != "" {
			continue
		}
		if err := exec(ctx, u, "CREATE EXTENSION citus"); err != nil {
			return "", err
		}
	}
	if template == "" {
		stmts := []string{"SELECT citus_set_coordinator_host('127.0.0.1', " + strconv.Itoa(nodes[0].Port) + ")"}
		for _, w := range nodes[1:] {
			stmts = append(stmts, "SELECT citus_add_node('127.0.0.1', "+strconv.Itoa(w.Port)+")")
		}
		if err := exec(ctx, nodes[0].URL(name), stmts...); err != nil {
			return "", err
		}
	}
	return nodes[0].URL(name), nil
}

// Freeze makes database name a template on every node: no connections
// from now on (Citus's maintenance daemon and connection caches hold
// some, and CREATE DATABASE copies only a database nobody is in).
func Freeze(ctx context.Context, name string) error {
	for _, n := range nodes {
		err := exec(ctx, n.URL("postgres"),
			"ALTER DATABASE "+pgx.Identifier{name}.Sanitize()+" ALLOW_CONNECTIONS false",
			"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "+quote(name))
		if err != nil {
			return err
		}
		// Terminated backends leave at once, but not before the
		// statement returns: wait until none is in the database.
		deadline := time.Now().Add(30 * time.Second)
		for {
			conn, err := pgx.Connect(ctx, n.URL("postgres"))
			if err != nil {
				return err
			}
			var in int
			err = conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = $1", name).Scan(&in)
			conn.Close(ctx)
			if err != nil {
				return err
			}
			if in == 0 {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("citustest: %d sessions still in %s on port %d", in, name, n.Port)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return nil
}

// WorkerURLs returns the URLs of database name on each worker node.
func WorkerURLs(name string) []string {
	var out []string
	for _, w := range nodes[1:] {
		out = append(out, w.URL(name))
	}
	return out
}

func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

func exec(ctx context.Context, url string, stmts ...string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	for _, s := range stmts {
		if _, err := conn.Exec(ctx, s); err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
	}
	return nil
}

// firstLine is the line of text holding mark.
func firstLine(text, mark string) string {
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, mark) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

// Package citustest gives tests a database on a real Citus cluster: a
// coordinator and PrivateWorkers workers started by localcitus, once per
// test binary at the first test that asks, or, with HIPQ_TEST_CITUS_URL
// set, the running cluster whose coordinator that URL names (its user may
// create databases, and this process reaches every node at the host and
// port the coordinator's pg_dist_node gives). Each test gets a database of
// its own, created on every node with the extension and the workers added
// to the coordinator's metadata, so each is a Citus cluster of its own; it
// is not migrated. A private cluster goes, databases and all, when the
// binary's tests end; on the cluster of HIPQ_TEST_CITUS_URL the databases
// made are dropped then, on every node.
//
// Without HIPQ_TEST_CITUS_URL, tests skip, saying why, on a machine where
// Citus is not installed beside PostgreSQL (no citus.control in its
// extension directory) or does not load into it.
package citustest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/localcitus"
)

// Enabled says whether the tests are to run on a Citus cluster
// (HIPQ_TEST_CITUS=1, as make test-citus sets). pgtest.OnCitus says the
// same; package store's own tests, which pgtest cannot serve (it imports
// store), ask here.
func Enabled() bool { return os.Getenv("HIPQ_TEST_CITUS") == "1" }

// PrivateWorkers is the number of worker nodes beside the coordinator of
// the cluster a test binary starts.
const PrivateWorkers = 2

// Workers is the number of worker nodes beside the coordinator of the
// cluster the tests run on (once a test asked for it).
func Workers() int {
	if cluster == nil {
		return 0
	}
	return cluster.Workers()
}

// urlEnv names the coordinator of a running cluster to use rather than
// start one.
const urlEnv = "HIPQ_TEST_CITUS_URL"

var (
	once     sync.Once
	cluster  *localcitus.Cluster
	skipWhy  string
	setupErr error
	seq      atomic.Int64
	prefix   = fmt.Sprintf("hipq_c%d_", os.Getpid())
)

// Installed reports whether Citus is installed beside the PostgreSQL
// localpg runs, and if not, where it looked.
func Installed() (bool, string) { return localcitus.Installed() }

func setup() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if u := os.Getenv(urlEnv); u != "" {
		if cluster, setupErr = localcitus.Attach(ctx, u); setupErr != nil {
			setupErr = fmt.Errorf("%s: %w", urlEnv, setupErr)
		}
		return
	}
	c, err := localcitus.Start(ctx, PrivateWorkers, localcitus.Options{})
	switch {
	case errors.Is(err, localcitus.ErrNoCitus):
		// The machine's setup, not hipq's code: the tests skip.
		skipWhy = err.Error() + ": these tests need a Citus cluster"
	case err != nil:
		setupErr = err
	default:
		cluster = c
	}
}

// Stop stops the cluster, if a test started it, or drops the databases
// made on the cluster of HIPQ_TEST_CITUS_URL. pgtest.Main calls it.
func Stop() {
	if cluster != nil {
		cluster.Stop()
	}
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
// and returns its URL on the coordinator (see localcitus's NewDatabase).
func NewDatabase(ctx context.Context, name, template string) (string, error) {
	if cluster == nil {
		return "", errors.New("citustest: the cluster is not started")
	}
	return cluster.NewDatabase(ctx, name, template)
}

// Freeze makes database name a template on every node of the started
// cluster (see localcitus's Freeze).
func Freeze(ctx context.Context, name string) error {
	if cluster == nil {
		return errors.New("citustest: the cluster is not started")
	}
	return cluster.Freeze(ctx, name)
}

// WorkerURLs returns the URLs of database name on each worker node.
func WorkerURLs(name string) []string {
	if cluster == nil {
		return nil
	}
	return cluster.WorkerURLs(name)
}

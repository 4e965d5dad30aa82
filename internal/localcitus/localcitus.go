// Package localcitus starts a private, throwaway Citus cluster: a
// coordinator and workers, each a PostgreSQL of its own (localpg) listening
// on 127.0.0.1 with the citus extension preloaded. It needs Citus
// installed beside the PostgreSQL that localpg runs; where it is not,
// Start returns an error wrapping ErrNoCitus.
//
// A cluster's databases are made by NewDatabase: the same database on
// every node, with the extension created and the workers added to the
// coordinator's metadata of it, so each database is a Citus cluster of
// its own.
package localcitus

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/internal/localpg"
)

// ErrNoCitus is what errors.Is finds in Start's error when no Citus
// cluster can start here: Citus is not installed beside PostgreSQL, or
// does not load into it. The error's text says which.
var ErrNoCitus = errors.New("no Citus")

// noCitus says why there is no Citus here, and is ErrNoCitus.
type noCitus string

func (e noCitus) Error() string      { return string(e) }
func (noCitus) Is(target error) bool { return target == ErrNoCitus }

// Options tune every node alike.
type Options struct {
	// Durable keeps fsync on (see localpg.Options).
	Durable bool
	// Settings are extra postgres -c settings. A shared_preload_libraries
	// among them is loaded after citus, which must come first.
	Settings map[string]string
}

// Cluster is a running throwaway Citus cluster.
type Cluster struct {
	// Nodes are the coordinator, then the workers.
	Nodes []*localpg.Cluster
}

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
	return false, fmt.Sprintf("Citus is not installed beside the PostgreSQL in %s (no citus.control at %v)", bin, candidates)
}

// Start starts a coordinator and workers workers, and waits until each
// accepts connections. Where Citus is not installed, or does not load,
// the error is ErrNoCitus (errors.Is) and says why.
func Start(ctx context.Context, workers int, opts Options) (*Cluster, error) {
	if workers < 1 {
		return nil, fmt.Errorf("localcitus: %d workers: a cluster needs at least one", workers)
	}
	if ok, why := Installed(); !ok {
		return nil, noCitus(why)
	}
	settings := map[string]string{
		// Citus commits a transaction that wrote on several nodes in two
		// phases.
		"max_prepared_transactions": "200",
		// The nodes talk over 127.0.0.1 without TLS (libpq would
		// otherwise look for client certificates in the home directory
		// of whoever started the cluster).
		"citus.node_conninfo": "sslmode=disable",
	}
	for k, v := range opts.Settings {
		settings[k] = v
	}
	// Citus refuses to start unless it is the first library loaded.
	settings["shared_preload_libraries"] = "citus"
	if more := strings.TrimSpace(opts.Settings["shared_preload_libraries"]); more != "" {
		settings["shared_preload_libraries"] = "citus," + more
	}
	c := &Cluster{}
	for range 1 + workers {
		n, err := localpg.Start(ctx, localpg.Options{TCP: true, Durable: opts.Durable, Settings: settings})
		if err != nil {
			c.Stop()
			if e := err.Error(); strings.Contains(e, "could not load library") && strings.Contains(e, "citus") {
				// Installed, but built for another PostgreSQL than this one.
				return nil, noCitus("Citus is installed but does not load into this PostgreSQL (built for another release of it): " +
					firstLine(e, "could not load library"))
			}
			return nil, fmt.Errorf("start a Citus node: %w", err)
		}
		c.Nodes = append(c.Nodes, n)
	}
	return c, nil
}

// Stop stops every node and removes its directory.
func (c *Cluster) Stop() {
	for _, n := range c.Nodes {
		n.Stop()
	}
	c.Nodes = nil
}

// Workers is the number of worker nodes.
func (c *Cluster) Workers() int { return len(c.Nodes) - 1 }

// URL returns the URL of database name on the coordinator.
func (c *Cluster) URL(name string) string { return c.Nodes[0].URL(name) }

// WorkerURLs returns the URLs of database name on each worker node.
func (c *Cluster) WorkerURLs(name string) []string {
	var out []string
	for _, w := range c.Nodes[1:] {
		out = append(out, w.URL(name))
	}
	return out
}

// NewDatabase creates database name on every node and returns its URL on
// the coordinator. Without a template, it creates the citus extension on
// every node and adds the workers to the coordinator's metadata of it.
// With one (a database Freeze made read-only, of every node), each node
// copies its own: the copy is the same cluster, metadata, shards and rows,
// under another name (Citus reaches a database's shards on the workers by
// the database's name).
func (c *Cluster) NewDatabase(ctx context.Context, name, template string) (string, error) {
	if len(c.Nodes) == 0 {
		return "", errors.New("localcitus: the cluster is stopped")
	}
	for _, n := range c.Nodes {
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
		stmts := []string{"SELECT citus_set_coordinator_host('127.0.0.1', " + strconv.Itoa(c.Nodes[0].Port) + ")"}
		for _, w := range c.Nodes[1:] {
			stmts = append(stmts, "SELECT citus_add_node('127.0.0.1', "+strconv.Itoa(w.Port)+")")
		}
		if err := exec(ctx, c.URL(name), stmts...); err != nil {
			return "", err
		}
	}
	return c.URL(name), nil
}

// Freeze makes database name a template on every node: no connections
// from now on (Citus's maintenance daemon and connection caches hold
// some, and CREATE DATABASE copies only a database nobody is in).
func (c *Cluster) Freeze(ctx context.Context, name string) error {
	for _, n := range c.Nodes {
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
				return fmt.Errorf("localcitus: %d sessions still in %s on port %d", in, name, n.Port)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return nil
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

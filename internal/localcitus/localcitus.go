// Package localcitus starts a private, throwaway Citus cluster: a
// coordinator and workers, each a PostgreSQL of its own (localpg) listening
// on 127.0.0.1 with the citus extension preloaded. It needs Citus
// installed beside the PostgreSQL that localpg runs; where it is not,
// Start returns an error wrapping ErrNoCitus. Attach uses a cluster that
// runs already instead, given its coordinator's URL.
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
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
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

// Cluster is a running Citus cluster: a throwaway one Start started, or
// one Attach attached to.
type Cluster struct {
	// Nodes are the coordinator, then the workers, of a cluster Start
	// started; none of one Attach attached to.
	Nodes []*localpg.Cluster
	// nodes are every node, the coordinator first.
	nodes []node
	// admin is the database of each node that CREATE DATABASE and the
	// like are sent to.
	admin string
	// attached: the cluster is not this process's; Stop drops the
	// databases NewDatabase made (made) rather than stop it.
	attached bool
	mu       sync.Mutex
	made     []string
}

// node is one node of a cluster.
type node struct {
	// host and port are how the other nodes reach it (its pg_dist_node
	// entry).
	host string
	port int
	// url is how this process connects to database db on it.
	url func(db string) string
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
		c.nodes = append(c.nodes, node{host: "127.0.0.1", port: n.Port, url: n.URL})
	}
	c.admin = "postgres"
	return c, nil
}

// Attach uses the running Citus cluster whose coordinator is at coordinator
// (a URL, or keyword/value connection string, whose user may create
// databases): its nodes are read from the pg_dist_node of the URL's
// database (which must have the citus extension and the workers added),
// and each is reached with the URL's user, password and parameters, at
// the host and port the coordinator knows it by. Stop drops the databases
// NewDatabase made on it, and leaves the cluster running.
func Attach(ctx context.Context, coordinator string) (*Cluster, error) {
	cfg, err := pgx.ParseConfig(coordinator)
	if err != nil {
		return nil, fmt.Errorf("localcitus: the coordinator's URL: %w", err)
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("localcitus: connect to the coordinator: %w", err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT groupid = 0, nodename, nodeport FROM pg_dist_node
		WHERE noderole = 'primary' AND isactive ORDER BY groupid, nodeid`)
	if err != nil {
		return nil, fmt.Errorf("localcitus: read the cluster's nodes from pg_dist_node of database %s (it needs the citus extension and the workers added): %w",
			cfg.Database, err)
	}
	var coord *node
	var workers []node
	var isCoord bool
	var host string
	var port int
	_, err = pgx.ForEachRow(rows, []any{&isCoord, &host, &port}, func() error {
		n := node{host: host, port: port, url: nodeURL(coordinator, host, port)}
		if isCoord {
			coord = &n
		} else {
			workers = append(workers, n)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("localcitus: read the cluster's nodes: %w", err)
	}
	if len(workers) == 0 {
		return nil, fmt.Errorf("localcitus: the cluster at %s:%d has no active worker in pg_dist_node of database %s", cfg.Host, cfg.Port, cfg.Database)
	}
	if coord == nil {
		// (A coordinator that was never told its own name: reached as the
		// URL reaches it.)
		coord = &node{host: cfg.Host, port: int(cfg.Port), url: nodeURL(coordinator, cfg.Host, int(cfg.Port))}
	}
	return &Cluster{nodes: append([]node{*coord}, workers...), admin: cfg.Database, attached: true}, nil
}

// nodeURL is a function giving base's URL of database db at host and
// port, with base's user, password and other parameters.
func nodeURL(base, host string, port int) func(db string) string {
	if u, err := url.Parse(base); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		return func(db string) string {
			v := *u
			q := v.Query()
			for _, k := range []string{"host", "hostaddr", "port", "dbname"} {
				q.Del(k)
			}
			v.RawQuery = q.Encode()
			v.Host = net.JoinHostPort(host, strconv.Itoa(port))
			v.Path, v.RawPath = "/"+db, ""
			return v.String()
		}
	}
	// Keyword/value: the last setting of a keyword wins.
	return func(db string) string {
		return fmt.Sprintf("%s host=%s port=%d dbname=%s", base, keywordValue(host), port, keywordValue(db))
	}
}

// keywordValue quotes v as a value of a keyword/value connection string.
func keywordValue(v string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v) + "'"
}

// Stop stops every node and removes its directory; on a cluster Attach
// attached to, it drops the databases NewDatabase made, on every node.
func (c *Cluster) Stop() {
	if c.attached {
		c.mu.Lock()
		made := c.made
		c.made = nil
		c.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for _, n := range c.nodes {
			for _, name := range made {
				_ = exec(ctx, n.url(c.admin), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
			}
		}
		c.nodes = nil
		return
	}
	for _, n := range c.Nodes {
		n.Stop()
	}
	c.Nodes, c.nodes = nil, nil
}

// Workers is the number of worker nodes.
func (c *Cluster) Workers() int { return len(c.nodes) - 1 }

// URL returns the URL of database name on the coordinator.
func (c *Cluster) URL(name string) string { return c.nodes[0].url(name) }

// WorkerURLs returns the URLs of database name on each worker node.
func (c *Cluster) WorkerURLs(name string) []string {
	var out []string
	for _, w := range c.nodes[1:] {
		out = append(out, w.url(name))
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
	if len(c.nodes) == 0 {
		return "", errors.New("localcitus: the cluster is stopped")
	}
	if c.attached {
		c.mu.Lock()
		c.made = append(c.made, name) // (dropped by Stop, made in part or whole)
		c.mu.Unlock()
	}
	create := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if template != "" {
		create += " TEMPLATE " + pgx.Identifier{template}.Sanitize()
	}
	for _, n := range c.nodes {
		if err := exec(ctx, n.url(c.admin), create); err != nil {
			return "", fmt.Errorf("node %s:%d: %w", n.host, n.port, err)
		}
		if template != "" {
			continue
		}
		if err := exec(ctx, n.url(name), "CREATE EXTENSION citus"); err != nil {
			return "", fmt.Errorf("node %s:%d: %w", n.host, n.port, err)
		}
	}
	if template == "" {
		stmts := []string{"SELECT citus_set_coordinator_host(" + quote(c.nodes[0].host) + ", " + strconv.Itoa(c.nodes[0].port) + ")"}
		for _, w := range c.nodes[1:] {
			stmts = append(stmts, "SELECT citus_add_node("+quote(w.host)+", "+strconv.Itoa(w.port)+")")
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
	for _, n := range c.nodes {
		err := exec(ctx, n.url(c.admin),
			"ALTER DATABASE "+pgx.Identifier{name}.Sanitize()+" ALLOW_CONNECTIONS false",
			"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "+quote(name))
		if err != nil {
			return err
		}
		// Terminated backends leave at once, but not before the
		// statement returns: wait until none is in the database.
		deadline := time.Now().Add(30 * time.Second)
		for {
			conn, err := pgx.Connect(ctx, n.url(c.admin))
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
				return fmt.Errorf("localcitus: %d sessions still in %s on port %d", in, name, n.port)
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

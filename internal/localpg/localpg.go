// Package localpg starts a private, throwaway PostgreSQL cluster from the
// server binaries installed on the machine (initdb and postgres, found on
// PATH or under /usr/lib/postgresql/*/bin). It listens on a Unix socket in
// its own directory only, so clusters never collide on a port.
//
// PostgreSQL refuses to run as root; as root the cluster runs as the
// "postgres" user, else "nobody", in a directory under the system temp
// directory that the user owns.
package localpg

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Options tune the cluster.
type Options struct {
	// Durable keeps fsync on. Tests turn it off for speed; nothing is lost
	// that matters there.
	Durable bool
	// Settings are extra postgres -c settings.
	Settings map[string]string
}

// Cluster is a running throwaway cluster.
type Cluster struct {
	Dir  string // removed by Stop
	cmd  *exec.Cmd
	done chan error
	bin  string
	args []string
	cred *syscall.Credential
}

// ErrNoServer is returned when no PostgreSQL server binaries are installed.
var ErrNoServer = errors.New("PostgreSQL server binaries (initdb, postgres) not found on PATH or under /usr/lib/postgresql/*/bin: install them (Debian: apt-get install -y postgresql) or set HIPQ_DATABASE_URL to an existing server")

// BinDir finds the directory holding initdb and postgres.
func BinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		dir := filepath.Dir(p)
		if real, err := filepath.EvalSymlinks(p); err == nil {
			dir = filepath.Dir(real)
		}
		if _, err := os.Stat(filepath.Join(dir, "postgres")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", ErrNoServer
}

func version(dir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return v
}

// runAs returns the credential to run PostgreSQL with: none unless root.
func runAs() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
	}
	return nil, errors.New("running as root and neither a postgres nor a nobody user exists to run PostgreSQL as")
}

// Start initializes and starts a cluster, and waits until it accepts
// connections.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	cred, err := runAs()
	if err != nil {
		return nil, err
	}
	parent := "" // the system temp directory
	if cred != nil {
		// $TMPDIR may sit where the unprivileged user cannot enter (/root/…).
		parent = "/tmp"
	}
	dir, err := os.MkdirTemp(parent, "hipq-pg-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{Dir: dir, done: make(chan error, 1)}
	fail := func(err error) (*Cluster, error) {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return fail(err)
		}
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fail(err)
	}
	data := filepath.Join(dir, "data")
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"), "-D", data, "-U", "hipq", "--auth=trust",
		"-E", "UTF8", "--no-locale", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		return fail(fmt.Errorf("initdb: %w\n%s", err, out))
	}
	args := []string{"-D", data, "-k", dir, "-c", "listen_addresses=", "-c", "max_connections=200",
		"-c", "shared_buffers=128MB", "-c", "max_locks_per_transaction=256"}
	if !opts.Durable {
		args = append(args, "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
	}
	for k, v := range opts.Settings {
		args = append(args, "-c", k+"="+v)
	}
	c.bin, c.args, c.cred = bin, args, cred
	if err := c.run(ctx); err != nil {
		return fail(err)
	}
	return c, nil
}

// run starts postgres on the cluster's data and waits until it accepts
// connections.
func (c *Cluster) run(ctx context.Context) error {
	logf, err := os.OpenFile(filepath.Join(c.Dir, "postgres.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	c.done = make(chan error, 1)
	c.cmd = exec.Command(filepath.Join(c.bin, "postgres"), c.args...)
	c.cmd.Dir = c.Dir
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	// SIGQUIT is PostgreSQL's immediate shutdown: if this process dies, so
	// does its cluster.
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Pdeathsig: syscall.SIGQUIT, Setpgid: true}
	if err := c.cmd.Start(); err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	go func(cmd *exec.Cmd, done chan error) { done <- cmd.Wait() }(c.cmd, c.done)
	deadline := time.Now().Add(60 * time.Second)
	for {
		conn, err := pgx.Connect(ctx, c.URL("postgres"))
		if err == nil {
			_ = conn.Close(ctx)
			return nil
		}
		select {
		case werr := <-c.done:
			return fmt.Errorf("postgres exited: %v\n%s", werr, c.Log())
		case <-ctx.Done():
			c.shutdown(syscall.SIGQUIT)
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			c.shutdown(syscall.SIGQUIT)
			return fmt.Errorf("postgres did not accept connections within 60s: %w", err)
		}
	}
}

// Restart stops the server (a fast shutdown: every connection is cut, as
// in a failover or an operator's restart) and starts it again on the same
// data, waiting until it accepts connections.
func (c *Cluster) Restart(ctx context.Context) error {
	c.Down()
	return c.Up(ctx)
}

// Down stops the server (a fast shutdown) and keeps its data.
func (c *Cluster) Down() { c.shutdown(syscall.SIGINT) }

// Up starts a server that is Down again, waiting until it accepts
// connections.
func (c *Cluster) Up(ctx context.Context) error { return c.run(ctx) }

func (c *Cluster) shutdown(sig syscall.Signal) {
	if c.cmd == nil || c.cmd.Process == nil {
		return
	}
	_ = c.cmd.Process.Signal(sig)
	// The exit status of a server told to stop says nothing new.
	select {
	case _ = <-c.done:
	case <-time.After(10 * time.Second):
		_ = syscall.Kill(-c.cmd.Process.Pid, syscall.SIGKILL)
		_ = <-c.done
	}
	c.cmd = nil
}

// URL is a connection string for database db.
func (c *Cluster) URL(db string) string {
	return fmt.Sprintf("host=%s port=5432 user=hipq dbname=%s sslmode=disable", c.Dir, db)
}

// CreateDatabase creates database name (optionally from a template) and
// returns its URL.
func (c *Cluster) CreateDatabase(ctx context.Context, name, template string) (string, error) {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return "", err
	}
	defer conn.Close(ctx)
	q := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if template != "" {
		q += " TEMPLATE " + pgx.Identifier{template}.Sanitize()
	}
	if _, err := conn.Exec(ctx, q); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	return c.URL(name), nil
}

// Stop shuts the cluster down at once and removes its directory.
func (c *Cluster) Stop() {
	c.shutdown(syscall.SIGQUIT)
	_ = os.RemoveAll(c.Dir)
}

// Log returns the server log, for test failures.
func (c *Cluster) Log() string {
	b, _ := os.ReadFile(filepath.Join(c.Dir, "postgres.log"))
	return strings.TrimSpace(string(b))
}

// Package localpg starts a private, throwaway PostgreSQL cluster from the
// server binaries installed on the machine (initdb and postgres, found on
// PATH or under /usr/lib/postgresql/*/bin). It listens on a Unix socket in
// its own directory only, so clusters never collide on a port; one asked
// to serve TLS listens on a free TCP port of 127.0.0.1 as well.
//
// PostgreSQL refuses to run as root; as root the cluster runs as the
// "postgres" user, else "nobody", in a directory under the system temp
// directory that the user owns.
package localpg

import (
	"context"
	"errors"
	"fmt"
	"net"
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
	// TLS, when set, serves TLS on TCP as well (see TLS).
	TLS *TLS
	// TCP makes a cluster without TLS listen on a free port of
	// 127.0.0.1 as well as on its socket, trusting every connection
	// there: for clusters that connect to each other, as the nodes of a
	// Citus cluster do.
	TCP bool
}

// TLS makes a cluster listen on 127.0.0.1 as well as on its socket, with
// ssl=on and a pg_hba.conf that lets TCP connections in over TLS only
// (hostssl): a connection without TLS is refused. The socket stays open
// without a password, for setting up.
type TLS struct {
	// CertFile and KeyFile are the server's certificate and key (PEM);
	// they are copied into the cluster's directory, where the server's
	// user may read them.
	CertFile, KeyFile string
	// ClientCAFile, when set, makes every TCP connection present a client
	// certificate it signed, whose common name is the user signing in
	// (pg_hba's cert method); without it, TCP connections over TLS are
	// trusted.
	ClientCAFile string
}

// Cluster is a running throwaway cluster.
type Cluster struct {
	Dir string // removed by Stop
	// Port is the server's port: of its socket, and with TLS of its TCP
	// listener on 127.0.0.1.
	Port int
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
	c := &Cluster{Dir: dir, Port: 5432, done: make(chan error, 1)}
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
	if opts.TLS != nil {
		more, err := c.serveTLS(data, cred, opts.TLS)
		if err != nil {
			return fail(err)
		}
		args = append(args, more...)
	} else if opts.TCP {
		port, err := freePort()
		if err != nil {
			return fail(err)
		}
		c.Port = port
		// initdb's pg_hba.conf trusts host connections from 127.0.0.1.
		args = append(args, "-c", "listen_addresses=127.0.0.1", "-c", "port="+strconv.Itoa(port))
	}
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

// serveTLS puts the certificates and a hostssl-only pg_hba.conf in place
// and returns the settings that serve them on a free TCP port.
func (c *Cluster) serveTLS(data string, cred *syscall.Credential, t *TLS) ([]string, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	c.Port = port
	files := map[string]string{"server.crt": t.CertFile, "server.key": t.KeyFile}
	if t.ClientCAFile != "" {
		files["client-ca.crt"] = t.ClientCAFile
	}
	for name, from := range files {
		b, err := os.ReadFile(from)
		if err != nil {
			return nil, err
		}
		to := filepath.Join(c.Dir, name)
		// PostgreSQL refuses a key others may read.
		if err := os.WriteFile(to, b, 0o600); err != nil {
			return nil, err
		}
		if cred != nil {
			if err := os.Chown(to, int(cred.Uid), int(cred.Gid)); err != nil {
				return nil, err
			}
		}
	}
	hba := "local all all trust\nhostssl all all 127.0.0.1/32 trust\n"
	if t.ClientCAFile != "" {
		hba = "local all all trust\nhostssl all all 127.0.0.1/32 cert\n"
	}
	if err := os.WriteFile(filepath.Join(data, "pg_hba.conf"), []byte(hba), 0o600); err != nil {
		return nil, err
	}
	if cred != nil {
		if err := os.Chown(filepath.Join(data, "pg_hba.conf"), int(cred.Uid), int(cred.Gid)); err != nil {
			return nil, err
		}
	}
	args := []string{"-c", "listen_addresses=127.0.0.1", "-c", "port=" + strconv.Itoa(port), "-c", "ssl=on",
		"-c", "ssl_cert_file=" + filepath.Join(c.Dir, "server.crt"), "-c", "ssl_key_file=" + filepath.Join(c.Dir, "server.key")}
	if t.ClientCAFile != "" {
		args = append(args, "-c", "ssl_ca_file="+filepath.Join(c.Dir, "client-ca.crt"))
	}
	return args, nil
}

// freePort is a TCP port free on 127.0.0.1 when asked.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
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
	return fmt.Sprintf("host=%s port=%d user=hipq dbname=%s sslmode=disable", c.Dir, c.Port, db)
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

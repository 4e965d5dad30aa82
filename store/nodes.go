package store

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/puddle/v2"
)

// On Citus, an instance may connect to any node: the coordinator or a
// worker. What PostgreSQL keeps per node is then not the cluster's:
//   - a NOTIFY is heard only by listeners on the node it was sent on, so
//     on Citus the store listens on every node (otherNodes), and a notice
//     sent anywhere wakes every instance;
//   - an advisory lock is held on the node that took it only, so on Citus
//     the claim lock is a row lock too (claimRowLockSQL), and the roles
//     of one instance at a time hold a lease row (leaseLock).

// node is one node of a Citus cluster, as the cluster's metadata names it.
type node struct {
	host string
	port uint16
}

func (n node) String() string { return fmt.Sprintf("%s:%d", n.host, n.port) }

// otherNodes lists the cluster's active primary nodes but the one the
// store's pool is connected to, as pg_dist_node names them (the names the
// nodes reach each other by).
func (s *Store) otherNodes(ctx context.Context) ([]node, error) {
	rows, err := s.pool.Query(ctx, `SELECT nodename, nodeport FROM pg_dist_node
		WHERE isactive AND noderole = 'primary' AND groupid <> (SELECT groupid FROM pg_dist_local_group)
		ORDER BY nodename, nodeport`)
	if err != nil {
		return nil, fmt.Errorf("list the cluster's nodes: %w", err)
	}
	var out []node
	var n node
	var port int32
	_, err = pgx.ForEachRow(rows, []any{&n.host, &port}, func() error {
		n.port = uint16(port)
		out = append(out, n)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list the cluster's nodes: %w", err)
	}
	return out, nil
}

// connectNode opens a connection of its own to n, with the pool's
// settings (user, password, database, TLS, runtime parameters) but n's
// host and port.
func (s *Store) connectNode(ctx context.Context, n node) (*pgx.Conn, error) {
	cc := s.pool.Config().ConnConfig.Copy()
	cc.Host, cc.Port = n.host, n.port
	cc.TLSConfig = tlsFor(cc.TLSConfig, n.host)
	// (The fallbacks are sslmode's other tries, prefer's plain one say,
	// and the URL's other hosts: each tries n.)
	for i, f := range cc.Fallbacks {
		fb := *f
		fb.Host, fb.Port, fb.TLSConfig = n.host, n.port, tlsFor(f.TLSConfig, n.host)
		cc.Fallbacks[i] = &fb
	}
	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	return pgx.ConnectConfig(cctx, cc)
}

// tlsFor is c for a connection to host (nil: no TLS).
func tlsFor(c *tls.Config, host string) *tls.Config {
	if c == nil {
		return nil
	}
	c = c.Clone()
	c.ServerName = host
	return c
}

// nodesRefresh is how often a store on Citus reads the cluster's nodes
// again while it listens (a worker added is listened on from then).
const nodesRefresh = time.Minute

// listenOtherNodes listens on channel on every node of the cluster but
// the pool's own, each on a connection of its own, while ctx lasts; the
// nodes are read again every nodesRefresh. A node that cannot be reached
// is reported to failed and tried again, later each time (up to 30 s):
// meanwhile its notices are missed, and the callers' polls stand in.
func (s *Store) listenOtherNodes(ctx context.Context, channel string, wake func(payload string), failed func(error)) {
	var wg sync.WaitGroup
	defer wg.Wait()
	running := map[node]context.CancelFunc{}
	defer func() {
		for _, stop := range running {
			stop()
		}
	}()
	for {
		nodes, err := s.otherNodes(ctx)
		if err != nil && ctx.Err() == nil && !errors.Is(err, puddle.ErrClosedPool) {
			failed(err)
		}
		if err == nil {
			seen := map[node]bool{}
			for _, n := range nodes {
				seen[n] = true
				if running[n] != nil {
					continue
				}
				nctx, stop := context.WithCancel(ctx)
				running[n] = stop
				wg.Add(1)
				go func() {
					defer wg.Done()
					s.listenNode(nctx, n, channel, wake, failed)
				}()
			}
			for n, stop := range running {
				if !seen[n] {
					stop()
					delete(running, n)
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(nodesRefresh):
		}
	}
}

// listenNode holds a connection to n LISTENing on channel while ctx lasts.
func (s *Store) listenNode(ctx context.Context, n node, channel string, wake func(payload string), failed func(error)) {
	backoff := time.Second
	for ctx.Err() == nil {
		err := func() error {
			conn, err := s.connectNode(ctx, n)
			if err != nil {
				return err
			}
			defer conn.Close(context.WithoutCancel(ctx))
			return listenOn(ctx, conn, channel, func(payload string) { backoff = time.Second; wake(payload) })
		}()
		if ctx.Err() != nil {
			return
		}
		failed(fmt.Errorf("listen for %s on the cluster's node %s: %w", channel, n, err))
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 30*time.Second)
	}
}

// leaseTTL is how long a lease of hipq_lock holds without being renewed
// (Lease.Alive renews it): how long a role whose holder died waits for
// another instance.
const leaseTTL = 15 * time.Second

// leaseLock tries to take the lease name of hipq_lock, the Citus form of
// sessionLock: it is free when nobody holds it or its holder's lease has
// passed. Its holder is named after this process (host, pid) and a token
// of this lease's own, as operators see it in hipq_lock.
func (s *Store) leaseLock(ctx context.Context, name, what string) (*Lease, bool, error) {
	holder, err := leaseHolder()
	if err != nil {
		return nil, false, fmt.Errorf("%s: %w", what, err)
	}
	ttl := leaseTTL.Seconds()
	// (The database's clock, read first: Citus refuses a function that is
	// not immutable in the conflict's condition.)
	var now time.Time
	if err := s.pool.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
		return nil, false, fmt.Errorf("%s: %w", what, err)
	}
	err = s.pool.QueryRow(ctx, `INSERT INTO hipq_lock AS l (name, holder, until) VALUES ($1, $2, $4)
		ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, until = excluded.until WHERE l.until < $3
		RETURNING 1`, name, holder, now, now.Add(leaseTTL)).Scan(new(int))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("%s: %w", what, err)
	}
	renew := func(ctx context.Context) error {
		tag, err := s.pool.Exec(ctx, `UPDATE hipq_lock SET until = now() + make_interval(secs => $3)
			WHERE name = $1 AND holder = $2`, name, holder, ttl)
		switch {
		case err != nil:
			return fmt.Errorf("%s: renew the lease: %w", what, err)
		case tag.RowsAffected() == 0:
			return fmt.Errorf("%s: the lease passed to another instance", what)
		}
		return nil
	}
	// The lease is renewed every third of its time, whatever its holder
	// does meanwhile (a long sweep, a relay waiting on a broker), and
	// Alive reports what the renewals found: an error once one failed, or
	// when none succeeded for two thirds of the lease's time (the holder
	// should stop before another instance may take it).
	var mu sync.Mutex
	var lost error
	renewed := time.Now()
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(leaseTTL / 3)
		defer t.Stop()
		for {
			select {
			case <-rctx.Done():
				return
			case <-t.C:
			}
			err := renew(rctx)
			mu.Lock()
			if err == nil {
				renewed = time.Now()
			} else if lost == nil && rctx.Err() == nil {
				lost = err
			}
			mu.Unlock()
		}
	}()
	return &Lease{
		alive: func(context.Context) error {
			mu.Lock()
			defer mu.Unlock()
			if lost != nil {
				return lost
			}
			if since := time.Since(renewed); since > 2*leaseTTL/3 {
				return fmt.Errorf("%s: the lease was not renewed for %v", what, since.Round(time.Second))
			}
			return nil
		},
		release: func() {
			stop()
			<-done
			rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			// (A failure leaves the lease to pass by itself.)
			_, _ = s.pool.Exec(rctx, `DELETE FROM hipq_lock WHERE name = $1 AND holder = $2`, name, holder)
		},
	}, true, nil
}

// leaseHolder names a new lease's holder.
func leaseHolder() (string, error) {
	host, _ := os.Hostname()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:])), nil
}

// Package store is hipq's only speaker of SQL: migrations, intake, claims,
// outcomes, sweeps, offsets and dead letters over PostgreSQL with pgx/v5.
//
// Every write that moves a job names its row by id and is guarded by the
// job's expected state and attempt, so a late writer changes nothing and the
// row count says so. Consumed Kafka offsets are written in the same
// transaction as their effects, as a compare-and-set.
package store

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Store is a pool of connections to hipq's database.
type Store struct {
	pool   *pgxpool.Pool
	schema string
	citus  string
	// dist: the database is a Citus cluster (the schema laid out for it,
	// or to be, by Migrate), and the statements that would span shards
	// take their distributed forms (see citus.go).
	dist   bool
	writes *writeWatch
	// events are the outcome events the statements that end jobs write
	// (nil: none).
	events *Events
}

// Defaults of Config.
const (
	DefaultSchema   = "public"
	DefaultMaxConns = 10
)

// Config says how to reach the database.
type Config struct {
	URL      string
	Schema   string // defaults to DefaultSchema
	MaxConns int32  // defaults to DefaultMaxConns
	// StatementTimeout bounds every statement on these connections
	// (PostgreSQL's statement_timeout); 0 = none.
	StatementTimeout time.Duration
	// CustomPlans plans every statement for its parameters' values
	// (plan_cache_mode force_custom_plan): lists whose filter values differ
	// wildly in frequency (a rare state) never run a cached generic plan
	// made for the average one.
	CustomPlans bool
	// Citus is CitusAuto (also ""), CitusOn or CitusOff: whether Migrate
	// lays the schema out for a Citus cluster (see citus.go).
	Citus string
}

// Open connects and checks the connection. Every connection uses the
// configured schema, which is created by Migrate when missing.
func Open(ctx context.Context, cfg Config) (*Store, error) { return open(ctx, cfg, nil) }

// open is Open whose pool's configuration tune changes last, when not nil:
// a test's hook (TestEveryWriteRoutesToOneShard watches every statement
// the store sends).
func open(ctx context.Context, cfg Config, tune func(*pgxpool.Config)) (*Store, error) {
	pc, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("database.url: %w", err)
	}
	switch cfg.Citus {
	case "", CitusAuto, CitusOn, CitusOff:
	default:
		return nil, fmt.Errorf("database.citus: %q is not one of [%s %s %s]", cfg.Citus, CitusAuto, CitusOn, CitusOff)
	}
	cfg.Schema = cmp.Or(cfg.Schema, DefaultSchema)
	pc.MaxConns = cmp.Or(cfg.MaxConns, DefaultMaxConns)
	pc.ConnConfig.RuntimeParams["search_path"] = cfg.Schema
	pc.ConnConfig.RuntimeParams["application_name"] = "hipq"
	if cfg.StatementTimeout > 0 {
		pc.ConnConfig.RuntimeParams["statement_timeout"] = strconv.FormatInt(cfg.StatementTimeout.Milliseconds(), 10)
	}
	if cfg.CustomPlans {
		pc.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_custom_plan"
	}
	// No JIT compilation unless someone chose it for these sessions:
	// hipq's statements reach rows by key and run in milliseconds, and JIT
	// would compile the few whose estimated cost passes jit_above_cost (the
	// sweeper's walks of running jobs, say) at every call, for longer
	// than they run.
	// Only a jit from the server's configuration (postgresql.conf, ALTER
	// SYSTEM) or its default is overridden, each connection once: one set
	// for the role or the database (ALTER ROLE/DATABASE ... SET), on the
	// server's command line, or by the URL (jit=on, options=-c jit=on)
	// stands, which a startup parameter would override.
	pc.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `SELECT set_config('jit', 'off', false) FROM pg_settings
			WHERE name = 'jit' AND source IN ('default', 'configuration file')`)
		return err
	}
	if tune != nil {
		tune(pc)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect to database: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to database: %w", err)
	}
	s := &Store{pool: pool, schema: cfg.Schema, citus: cfg.Citus, writes: &writeWatch{running: map[uint64]time.Time{}}}
	if s.dist, err = s.laidOutForCitus(pctx); err != nil {
		pool.Close()
		return nil, err
	}
	return s, nil
}

// Close closes every connection.
func (s *Store) Close() { s.pool.Close() }

// Pool gives tests a raw pool. Nothing outside this package uses it:
// LISTEN is WaitJobReady and WaitIntake, a ping Ping.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Ping checks that the database answers.
func (s *Store) Ping(ctx context.Context) error { return s.pool.Ping(ctx) }

// ErrOffsetConflict is returned when the stored offset of a partition is not
// the one the consumer expected: another instance applied these records, or
// this one lost the partition. Nothing was written; re-seek.
var ErrOffsetConflict = errors.New("stored offset moved: another consumer applied these records")

// inTx runs fn in a transaction, retrying on deadlock and serialization
// failures, which PostgreSQL says are safe to retry whole, while ctx lasts.
func (s *Store) inTx(ctx context.Context, fn func(pgx.Tx) error) error {
	return s.inTxOpen(ctx, nil, fn)
}

// inTxOpen is inTx whose BEGIN goes to PostgreSQL in one round trip with
// the statements open queues, when open is not nil: pgx sends a batch as
// one pipeline and reads the answers in order, running their callbacks.
// So a transaction's first statements, those whose answers nothing before
// fn needs, cost no round trip of their own (under load, each one is a
// wait for a CPU at both ends while the transaction holds its locks). An
// error of a queued statement or of its callback ends the try as one of
// fn's would: rolled back, fn not run. But the server has run the whole
// batch by then (a callback's refusal is the client's): queue nothing
// that takes locks after a statement whose callback may refuse, as the
// offsets' compare-and-set may. open runs on each try, on a new batch;
// its own error ends the try before anything is sent.
func (s *Store) inTxOpen(ctx context.Context, open func(*pgx.Batch) error, fn func(pgx.Tx) error) error {
	defer s.writes.start()()
	if s.dist {
		inner := fn
		fn = func(tx pgx.Tx) error { return inner(citusTx{tx}) }
	}
	var err error
	for try := 0; try < 5; try++ {
		if open == nil {
			err = pgx.BeginFunc(ctx, s.pool, fn)
		} else {
			err = s.txOpened(ctx, open, fn)
		}
		if !retryableTx(err) {
			return err
		}
		t := time.NewTimer(time.Duration(try+1) * 10 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
	return err
}

// txOpened is one try of inTxOpen, as pgx.BeginFunc's: rolled back
// unless fn returns nil, then committed.
func (s *Store) txOpened(ctx context.Context, open func(*pgx.Batch) error, fn func(pgx.Tx) error) (err error) {
	b := &pgx.Batch{}
	// (Read committed, whatever the database's default: what a statement
	// reads after a lock it waited for, the claim lock of a queue with
	// limits say, is read after the lock.)
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err := open(b); err != nil {
		return err
	}
	br := s.pool.SendBatch(ctx, b)
	tx := br.Tx() // (closed already if the batch never reached the server)
	defer func() {
		if rerr := tx.Rollback(ctx); rerr != nil && !errors.Is(rerr, pgx.ErrTxClosed) && err == nil {
			err = rerr
		}
	}()
	if err := br.Close(); err != nil {
		_ = tx.Rollback(ctx) // (its error is not the one to report)
		return err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback(ctx)
		return err
	}
	return tx.Commit(ctx)
}

// execer runs statements whose only answer is whether they succeeded: a
// transaction, or queued (a batch opening one: see inTxOpen). Queued, the
// command tag is empty: a statement whose rows affected are read (a
// guarded write's) is not run through one.
type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// queued is an execer that queues its statements on a batch. A statement's
// error is the batch's, wrapped with what.
type queued struct {
	b    *pgx.Batch
	what string
}

func (q queued) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.b.Queue(sql, args...).Fn = func(br pgx.BatchResults) error {
		if _, err := br.Exec(); err != nil {
			return fmt.Errorf("%s: %w", q.what, err)
		}
		return nil
	}
	return pgconn.CommandTag{}, nil
}

func retryableTx(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "40P01" || pe.Code == "40001")
}

// writeWatch keeps the start times of the write transactions running, so
// readiness can tell PostgreSQL is accepting connections but not finishing
// writes (a full disk, a lock held for too long, a failing replica in
// synchronous commit).
type writeWatch struct {
	mu      sync.Mutex
	next    uint64
	running map[uint64]time.Time
}

func (w *writeWatch) start() (done func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.next++
	id := w.next
	w.running[id] = time.Now()
	return func() {
		w.mu.Lock()
		delete(w.running, id)
		w.mu.Unlock()
	}
}

// WriteStalled returns an error while a write transaction has been running
// for longer than deadline, nil otherwise.
func (s *Store) WriteStalled(deadline time.Duration) error {
	s.writes.mu.Lock()
	defer s.writes.mu.Unlock()
	var oldest time.Time
	for _, t := range s.writes.running {
		if oldest.IsZero() || t.Before(oldest) {
			oldest = t
		}
	}
	if !oldest.IsZero() && time.Since(oldest) > deadline {
		return fmt.Errorf("a PostgreSQL write has been running for %s (readiness deadline %s)", time.Since(oldest).Round(time.Second), deadline)
	}
	return nil
}

// tryAgain runs write under a savepoint of tx. Should PostgreSQL refuse
// it (an error neither transient nor of ctx), the savepoint rolls back,
// leaving tx as it was before, the dead letters instead are written, and
// the refusal is returned as refused; any other error is err, and tx is
// no more of use.
func tryAgain(ctx context.Context, tx pgx.Tx, write func(pgx.Tx) error, instead []DeadLetter) (refused, err error) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("savepoint: %w", err)
	}
	werr := write(sp)
	if werr == nil {
		if err := sp.Commit(ctx); err != nil {
			return nil, fmt.Errorf("release savepoint: %w", err)
		}
		return nil, nil
	}
	if IsTransient(werr) || ctx.Err() != nil {
		return nil, werr
	}
	if err := sp.Rollback(ctx); err != nil {
		return nil, fmt.Errorf("rollback to savepoint: %w (after %w)", err, werr)
	}
	return werr, deadLettersInsert(ctx, tx, instead)
}

package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/schemas"
)

// migrationLock is the advisory lock key taken while migrating, so rolling
// restarts of many instances migrate once.
const migrationLock = 0x68697071_6d696772 // "hipqmigr"

// migrationPoll is how often an instance asks for the migration lock while
// another holds it.
const migrationPoll = 250 * time.Millisecond

// Migration is one embedded schema change: a versioned migration
// (schemas/migrations/NNNN_name.sql, Version > 0), applied once, in order,
// or a repeatable one (schemas/repeatable/NAME.sql, Version 0), which
// defines SQL functions with CREATE OR REPLACE and is applied again
// whenever its text changes.
type Migration struct {
	Version   int
	Name      string
	SQL       string
	AppliedAt *time.Time
}

// Repeatable reports whether m is a repeatable migration.
func (m Migration) Repeatable() bool { return m.Version == 0 }

// Checksum is the hex SHA-256 of the migration's text: a repeatable one is
// applied again when it differs from the one recorded.
func (m Migration) Checksum() string {
	sum := sha256.Sum256([]byte(m.SQL))
	return hex.EncodeToString(sum[:])
}

// String names the migration as its file does: 0001_init, or repeatable
// hipq_intake_notify.
func (m Migration) String() string {
	if m.Repeatable() {
		return "repeatable " + m.Name
	}
	return fmt.Sprintf("%04d_%s", m.Version, m.Name)
}

// Migrations lists the embedded migrations in order.
func Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(schemas.Migrations, "migrations")
	if err != nil {
		return nil, err
	}
	var ms []Migration
	for _, e := range entries {
		num, name, ok := strings.Cut(strings.TrimSuffix(e.Name(), ".sql"), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration file %q is not NNNN_name.sql", e.Name())
		}
		b, err := fs.ReadFile(schemas.Migrations, path.Join("migrations", e.Name()))
		if err != nil {
			return nil, err
		}
		ms = append(ms, Migration{Version: v, Name: name, SQL: string(b)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].Version < ms[j].Version })
	return ms, nil
}

// Repeatables lists the embedded repeatable migrations in name order, the
// order they are applied in.
func Repeatables() ([]Migration, error) {
	entries, err := fs.ReadDir(schemas.Repeatable, "repeatable")
	if err != nil {
		return nil, err
	}
	var rs []Migration
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".sql")
		if !ok || name == "" || strings.Trim(name, "abcdefghijklmnopqrstuvwxyz0123456789_") != "" {
			return nil, fmt.Errorf("repeatable migration file %q is not name.sql (lower case letters, digits and _)", e.Name())
		}
		b, err := fs.ReadFile(schemas.Repeatable, path.Join("repeatable", e.Name()))
		if err != nil {
			return nil, err
		}
		rs = append(rs, Migration{Name: name, SQL: string(b)})
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i].Name < rs[j].Name })
	return rs, nil
}

// noTransaction, as a migration's first line, runs it statement by
// statement outside a transaction: what CREATE INDEX CONCURRENTLY needs, so
// that building an index over a big table never stops the writes. Each of
// its statements must be safe to run again (a crash between two leaves the
// migration unrecorded, to be run again whole).
const noTransaction = "-- hipq: no transaction"

// NoTransaction reports whether the migration runs outside a transaction.
func (m Migration) NoTransaction() bool {
	first, _, _ := strings.Cut(m.SQL, "\n")
	return strings.TrimSpace(first) == noTransaction
}

// Statements splits a migration into its statements: each ends with a
// semicolon at the end of a line outside a dollar-quoted body (a function's
// or a DO block's: an odd count of "$$" on a line opens or closes one), and
// blank lines and comment lines outside such bodies are dropped. It is not a parser: a "$$" inside a
// string or a comment on a line with code counts too.
func (m Migration) Statements() []string {
	var out []string
	var cur strings.Builder
	quoted := false
	for _, line := range strings.Split(m.SQL, "\n") {
		if t := strings.TrimSpace(line); !quoted && (t == "" || strings.HasPrefix(t, "--")) {
			continue // (inside a body, every line is kept as written)
		}
		cur.WriteString(line + "\n")
		if strings.Count(line, "$$")%2 == 1 {
			quoted = !quoted
		}
		if !quoted && strings.HasSuffix(strings.TrimSpace(line), ";") {
			out = append(out, strings.TrimSpace(cur.String()))
			cur.Reset()
		}
	}
	if t := strings.TrimSpace(cur.String()); t != "" {
		out = append(out, t)
	}
	return out
}

// A migration's statements wait at most migrationLockWait for a lock, and
// are tried again after a pause, up to migrationLockTries times. A
// statement queued for a table's exclusive lock (ALTER TABLE) blocks
// every statement on that table behind it: behind a long transaction it
// would stop the writes for as long as that lasts. It gives way instead.
const (
	migrationLockWait  = 2 * time.Second
	migrationLockTries = 60
)

func lockTimeoutFor(bounded bool) string {
	if !bounded {
		return "0"
	}
	return strconv.FormatInt(migrationLockWait.Milliseconds(), 10)
}

// lockBounded runs fn again while it fails for a lock it could not take
// in time (lock_timeout), pausing between tries.
func lockBounded(ctx context.Context, fn func() error) error {
	for try := 1; ; try++ {
		err := fn()
		var pe *pgconn.PgError
		if err == nil || !errors.As(err, &pe) || pe.Code != "55P03" {
			return err
		}
		if try == migrationLockTries {
			return fmt.Errorf("could not take a table lock within %v, %d times: a long transaction holds it (see pg_stat_activity): %w",
				migrationLockWait, try, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(migrationPoll):
		}
	}
}

// LatestVersion is the newest schema version this binary knows.
func LatestVersion() int {
	ms, _ := Migrations()
	if len(ms) == 0 {
		return 0
	}
	return ms[len(ms)-1].Version
}

// ErrSchemaTooNew is returned when the database was migrated by a newer hipq.
type ErrSchemaTooNew struct{ Database, Binary int }

func (e *ErrSchemaTooNew) Error() string {
	return fmt.Sprintf("database schema is at version %d, newer than this hipq knows (%d): upgrade hipq", e.Database, e.Binary)
}

// Migrate applies every pending migration under an advisory lock, the
// versioned ones in order, then the repeatable ones whose text is not the
// one recorded, in name order; it returns those it applied. It is
// idempotent, and refuses a schema newer than this binary.
//
// A repeatable migration runs only once the database is at this binary's
// latest version, so it never meets an older table layout, each in a
// transaction of its own, recorded in hipq_schema_repeatable with its
// checksum. Instances migrating at once take turns on the lock: the next
// finds the checksums recorded and applies nothing. When any versioned
// migration is to run, the recorded checksums are deleted first, so every
// repeatable one is applied again after it: older versioned migrations
// define the same functions (their history), and a versioned migration
// may change what a function reads. A run cut short in between still
// applies them at the next start.
func (s *Store) Migrate(ctx context.Context) (applied []Migration, err error) {
	return s.migrate(ctx, false, nil)
}

// MigrateDistribute is Migrate that, on Citus, also moves the rows of a
// schema laid out on one PostgreSQL onto the cluster's layout (hipq
// migrate --distribute): each table Citus does not know yet is
// distributed (or made a reference table) with its rows, which Citus
// copies into its shards, and its local copy emptied. No other hipq may be
// connected meanwhile: it refuses, naming how many are, when one is.
// types are the config's job types: an early reply kept without a queue
// (before replies had one, its job unknown then) takes its type's, and
// one of a type they do not name is dead-lettered, as the sweep would do.
func (s *Store) MigrateDistribute(ctx context.Context, types correlator.Types) ([]Migration, error) {
	return s.migrate(ctx, true, types)
}

// migratedOnWorker is Migrate on a worker of a Citus cluster, which runs
// no DDL of hipq's (Citus takes a schema's changes from the coordinator):
// nil when the schema is already the one this binary needs, else an error
// saying to migrate against the coordinator.
func (s *Store) migratedOnWorker(ctx context.Context, conn *pgxpool.Conn, moveRows bool) error {
	// (Two statements: one that reads the coordinator's table runs there
	// whole, to_regclass included, outside this session's search_path.)
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regclass('hipq_schema_migration') IS NOT NULL").Scan(&exists); err != nil {
		return fmt.Errorf("migrate: read version: %w", err)
	}
	var current int
	if exists {
		if err := conn.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM hipq_schema_migration").Scan(&current); err != nil {
			return fmt.Errorf("migrate: read version: %w", err)
		}
	}
	latest := LatestVersion()
	switch {
	case current > latest:
		return &ErrSchemaTooNew{Database: current, Binary: latest}
	case current < latest || moveRows:
		return fmt.Errorf("migrate: %w (schema version %d, this hipq needs %d)", ErrWorkerNode, current, latest)
	}
	return nil
}

// ErrWorkerNode is returned by Migrate on a worker of a Citus cluster
// whose schema is behind this binary's.
var ErrWorkerNode = errors.New("database.url names a worker of the Citus cluster, where hipq's schema cannot be changed (Citus takes DDL from the coordinator): run hipq migrate with the coordinator's URL, then start hipq on any node")

// ErrHipqRunning is returned by MigrateDistribute while other hipq
// sessions are connected to the database.
var ErrHipqRunning = errors.New("other hipq sessions are connected to this database: stop every hipq before moving its rows onto the cluster")

func (s *Store) migrate(ctx context.Context, moveRows bool, types correlator.Types) (applied []Migration, err error) {
	ms, err := Migrations()
	if err != nil {
		return nil, err
	}
	rs, err := Repeatables()
	if err != nil {
		return nil, err
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	defer conn.Release()
	// The lock is polled, not waited for in one statement: a statement
	// waiting holds a snapshot, and CREATE INDEX CONCURRENTLY in the
	// holder's migration waits for every older snapshot to end: each would
	// wait for the other (PostgreSQL aborts one as a deadlock).
	for {
		var got bool
		if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", int64(migrationLock)).Scan(&got); err != nil {
			return nil, fmt.Errorf("migrate: take lock: %w", err)
		}
		if got {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("migrate: wait for another instance's migration: %w", ctx.Err())
		case <-time.After(migrationPoll):
		}
	}
	// The deferred unlock and resets fail only on a broken connection, whose
	// session ended and took the lock and the settings with it.
	defer conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", int64(migrationLock)) //nolint:errcheck // see above
	// A migration is not bounded by a statement timeout of the role, the
	// database or the URL: a batched fill or a concurrent index build cut
	// short would only start over at the next start, and never end.
	if _, err := conn.Exec(ctx, "SET statement_timeout = 0"); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	defer conn.Exec(context.WithoutCancel(ctx), "RESET statement_timeout") //nolint:errcheck // a broken connection only
	defer conn.Exec(context.WithoutCancel(ctx), "RESET lock_timeout")      //nolint:errcheck // a broken connection only
	citus, err := s.onCitus(ctx, conn)
	if err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if moveRows && !citus {
		return nil, fmt.Errorf("migrate --distribute: %w", ErrNoCitus)
	}
	if citus {
		// (Group 0 is the coordinator's, nodes added or not yet, where
		// citus_is_coordinator() says false until some are.)
		var coordinator bool
		if err := conn.QueryRow(ctx, "SELECT groupid = 0 FROM pg_dist_local_group").Scan(&coordinator); err != nil {
			return nil, fmt.Errorf("migrate: %w", err)
		}
		if !coordinator {
			return nil, s.migratedOnWorker(ctx, conn, moveRows)
		}
	}
	if moveRows {
		// Only other processes' sessions count: this pool's idle
		// connections (and this one) are left out by their pids.
		pids := []uint32{conn.Conn().PgConn().PID()}
		for _, c := range s.pool.AcquireAllIdle(ctx) {
			pids = append(pids, c.Conn().PgConn().PID())
			c.Release()
		}
		var others int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'hipq' AND pid <> ALL($1::int[])`, pids).Scan(&others); err != nil {
			return nil, fmt.Errorf("migrate --distribute: %w", err)
		}
		if others > 0 {
			return nil, fmt.Errorf("migrate --distribute: %d sessions: %w", others, ErrHipqRunning)
		}
	}
	if citus {
		// Repeatable migrations re-create hipq_event's trigger, on a
		// distributed table once the schema is laid out.
		if _, err := conn.Exec(ctx, citusEnableTriggers); err != nil {
			return nil, fmt.Errorf("migrate: %w", err)
		}
		defer conn.Exec(context.WithoutCancel(ctx), "RESET citus.enable_unsafe_triggers") //nolint:errcheck // a broken connection only
	}
	if _, err := conn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{s.schema}.Sanitize()); err != nil {
		return nil, fmt.Errorf("migrate: create schema %q: %w", s.schema, err)
	}
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS hipq_schema_migration (
		version int PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS hipq_schema_repeatable (
		name text PRIMARY KEY, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	var current int
	if err := conn.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM hipq_schema_migration").Scan(&current); err != nil {
		return nil, fmt.Errorf("migrate: read version: %w", err)
	}
	latest := LatestVersion()
	if current > latest {
		return nil, &ErrSchemaTooNew{Database: current, Binary: latest}
	}
	if current < latest {
		if _, err := conn.Exec(ctx, "DELETE FROM hipq_schema_repeatable"); err != nil {
			return nil, fmt.Errorf("migrate: %w", err)
		}
	}
	for _, m := range ms {
		if m.Version <= current {
			continue
		}
		record := "INSERT INTO hipq_schema_migration (version, name) VALUES ($1, $2)"
		if m.NoTransaction() {
			for _, stmt := range m.Statements() {
				// CREATE INDEX CONCURRENTLY waits for older transactions
				// (a lock too) without blocking anyone: it may wait.
				bounded := !strings.Contains(strings.ToUpper(stmt), "CONCURRENTLY")
				if err = lockBounded(ctx, func() error {
					if _, err := conn.Exec(ctx, "SELECT set_config('lock_timeout', $1, false)", lockTimeoutFor(bounded)); err != nil {
						return err
					}
					_, err := conn.Exec(ctx, stmt)
					return err
				}); err != nil {
					break
				}
			}
			if err == nil {
				_, err = conn.Exec(ctx, record, m.Version, m.Name)
			}
		} else {
			err = lockBounded(ctx, func() error {
				return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, "SELECT set_config('lock_timeout', $1, true)", lockTimeoutFor(true)); err != nil {
						return err
					}
					if err := execMigration(ctx, tx, m, citus); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, record, m.Version, m.Name)
					return err
				})
			})
		}
		if err != nil {
			return applied, fmt.Errorf("migrate: apply %s: %w", m, err)
		}
		applied = append(applied, m)
	}
	recorded, err := recordedChecksums(ctx, conn)
	if err != nil {
		return applied, fmt.Errorf("migrate: %w", err)
	}
	for _, r := range rs {
		if recorded[r.Name] == r.Checksum() {
			continue
		}
		err = lockBounded(ctx, func() error {
			return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "SELECT set_config('lock_timeout', $1, true)", lockTimeoutFor(true)); err != nil {
					return err
				}
				if err := execMigration(ctx, tx, r, citus); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `INSERT INTO hipq_schema_repeatable (name, checksum) VALUES ($1, $2)
					ON CONFLICT (name) DO UPDATE SET checksum = EXCLUDED.checksum, applied_at = EXCLUDED.applied_at`, r.Name, r.Checksum())
				return err
			})
		})
		if err != nil {
			return applied, fmt.Errorf("migrate: apply %s: %w", r, err)
		}
		applied = append(applied, r)
	}
	if citus {
		if err := distribute(ctx, conn.Conn(), moveRows, types); err != nil {
			return applied, fmt.Errorf("migrate: %w", err)
		}
		s.dist = true
	}
	return applied, nil
}

// execMigration runs the text of a migration that runs in a transaction,
// in tx: whole, in one simple query, or on Citus statement by statement.
// Citus sends some DDL on to the workers as the text of the query that
// carried it, with the extended protocol, which takes one statement only:
// a migration's whole text would be refused there ("cannot insert multiple
// commands into a prepared statement") once its tables are distributed.
func execMigration(ctx context.Context, tx pgx.Tx, m Migration, citus bool) error {
	if !citus {
		_, err := tx.Exec(ctx, m.SQL)
		return err
	}
	for _, stmt := range m.Statements() {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			return err
		}
	}
	return nil
}

// querier is a connection or a pool.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// recordedChecksums reads hipq_schema_repeatable: the checksum each
// repeatable migration was last applied with (none when the table is not
// there).
func recordedChecksums(ctx context.Context, q querier) (map[string]string, error) {
	out := map[string]string{}
	var exists bool
	if err := q.QueryRow(ctx, "SELECT to_regclass('hipq_schema_repeatable') IS NOT NULL").Scan(&exists); err != nil || !exists {
		return out, err
	}
	rows, err := q.Query(ctx, "SELECT name, checksum FROM hipq_schema_repeatable")
	if err != nil {
		return nil, err
	}
	var name, sum string
	_, err = pgx.ForEachRow(rows, []any{&name, &sum}, func() error { out[name] = sum; return nil })
	return out, err
}

// MigrationStatus lists every known versioned migration with when it was
// applied, and the database's version.
func (s *Store) MigrationStatus(ctx context.Context) ([]Migration, int, error) {
	ms, err := Migrations()
	if err != nil {
		return nil, 0, err
	}
	var exists bool
	if err := s.pool.QueryRow(ctx, "SELECT to_regclass('hipq_schema_migration') IS NOT NULL").Scan(&exists); err != nil {
		return nil, 0, fmt.Errorf("migration status: %w", err)
	}
	current := 0
	if exists {
		rows, err := s.pool.Query(ctx, "SELECT version, applied_at FROM hipq_schema_migration")
		if err != nil {
			return nil, 0, fmt.Errorf("migration status: %w", err)
		}
		at := map[int]time.Time{}
		var v int
		var t time.Time
		if _, err := pgx.ForEachRow(rows, []any{&v, &t}, func() error { at[v] = t; current = max(current, v); return nil }); err != nil {
			return nil, 0, fmt.Errorf("migration status: %w", err)
		}
		for i := range ms {
			if t, ok := at[ms[i].Version]; ok {
				ms[i].AppliedAt = &t
			}
		}
	}
	return ms, current, nil
}

// RepeatableStatus lists every known repeatable migration, with when it
// was applied when the database holds this binary's text of it (AppliedAt
// is nil for one never applied, or applied from another text: pending).
func (s *Store) RepeatableStatus(ctx context.Context) ([]Migration, error) {
	rs, err := Repeatables()
	if err != nil {
		return nil, err
	}
	var exists bool
	if err := s.pool.QueryRow(ctx, "SELECT to_regclass('hipq_schema_repeatable') IS NOT NULL").Scan(&exists); err != nil {
		return nil, fmt.Errorf("repeatable migration status: %w", err)
	}
	if !exists {
		return rs, nil
	}
	rows, err := s.pool.Query(ctx, "SELECT name, checksum, applied_at FROM hipq_schema_repeatable")
	if err != nil {
		return nil, fmt.Errorf("repeatable migration status: %w", err)
	}
	type rec struct {
		sum string
		at  time.Time
	}
	got := map[string]rec{}
	var name, sum string
	var at time.Time
	if _, err := pgx.ForEachRow(rows, []any{&name, &sum, &at}, func() error { got[name] = rec{sum, at}; return nil }); err != nil {
		return nil, fmt.Errorf("repeatable migration status: %w", err)
	}
	for i := range rs {
		if r, ok := got[rs[i].Name]; ok && r.sum == rs[i].Checksum() {
			rs[i].AppliedAt = &r.at
		}
	}
	return rs, nil
}

// CheckSchema returns an error unless the database is at exactly this
// binary's schema: its version, and every repeatable migration applied
// from this binary's text.
func (s *Store) CheckSchema(ctx context.Context) error {
	_, current, err := s.MigrationStatus(ctx)
	if err != nil {
		return err
	}
	latest := LatestVersion()
	switch {
	case current > latest:
		return &ErrSchemaTooNew{Database: current, Binary: latest}
	case current < latest:
		return fmt.Errorf("database schema is at version %d, this hipq needs %d: run `hipq migrate`", current, latest)
	}
	rs, err := s.RepeatableStatus(ctx)
	if err != nil {
		return err
	}
	var pending []string
	for _, r := range rs {
		if r.AppliedAt == nil {
			pending = append(pending, r.Name)
		}
	}
	if len(pending) > 0 {
		return fmt.Errorf("database schema is at version %d, but its repeatable migrations %s are not applied from this hipq's text (never, or from another build's): run `hipq migrate` with this build",
			current, strings.Join(pending, ", "))
	}
	return nil
}

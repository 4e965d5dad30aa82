package store

import (
	"context"
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

	"github.com/hipq/hipq/schemas"
)

// migrationLock is the advisory lock key taken while migrating, so rolling
// restarts of many instances migrate once.
const migrationLock = 0x68697071_6d696772 // "hipqmigr"

// migrationPoll is how often an instance asks for the migration lock while
// another holds it.
const migrationPoll = 250 * time.Millisecond

// Migration is one embedded schema change.
type Migration struct {
	Version   int
	Name      string
	SQL       string
	AppliedAt *time.Time
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

// Migrate applies every pending migration under an advisory lock. It is
// idempotent, and refuses a schema newer than this binary.
func (s *Store) Migrate(ctx context.Context) (applied []Migration, err error) {
	ms, err := Migrations()
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
	if _, err := conn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{s.schema}.Sanitize()); err != nil {
		return nil, fmt.Errorf("migrate: create schema %q: %w", s.schema, err)
	}
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS hipq_schema_migration (
		version int PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	var current int
	if err := conn.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM hipq_schema_migration").Scan(&current); err != nil {
		return nil, fmt.Errorf("migrate: read version: %w", err)
	}
	if latest := LatestVersion(); current > latest {
		return nil, &ErrSchemaTooNew{Database: current, Binary: latest}
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
					if _, err := tx.Exec(ctx, m.SQL); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, record, m.Version, m.Name)
					return err
				})
			})
		}
		if err != nil {
			return applied, fmt.Errorf("migrate: apply %04d_%s: %w", m.Version, m.Name, err)
		}
		applied = append(applied, m)
	}
	return applied, nil
}

// MigrationStatus lists every known migration with when it was applied.
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

// CheckSchema returns an error unless the database is at exactly this
// binary's schema version.
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
	return nil
}

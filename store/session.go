package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// UISession is a dashboard session as stored: the hash of the token it
// was signed in with and that token's role then ("admin" or "read").
type UISession struct {
	TokenHash []byte
	Role      string
}

// UISessionCreate stores a new session (idHash, the hash of its random id)
// expiring ttl from now. In the same transaction it deletes the expired
// sessions, and the session with the id hash replaces (the browser's
// previous one), when given.
func (s *Store) UISessionCreate(ctx context.Context, idHash []byte, sess UISession, ttl time.Duration, replaces []byte) error {
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `DELETE FROM hipq_ui_session WHERE expires_at <= now() OR id_hash = $1`, replaces); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO hipq_ui_session (id_hash, token_hash, role, expires_at)
			VALUES ($1, $2, $3, now() + $4::bigint * interval '1 millisecond')`, idHash, sess.TokenHash, sess.Role, ttl.Milliseconds())
		return err
	})
	if err != nil {
		return fmt.Errorf("create dashboard session: %w", err)
	}
	return nil
}

// UISessionTouch returns the unexpired session with idHash, or nil. Its
// expiry slides to ttl from now when less than ttl - slack was left, so a
// dashboard refreshing every few seconds writes the row once per slack,
// not at every refresh.
func (s *Store) UISessionTouch(ctx context.Context, idHash []byte, ttl, slack time.Duration) (*UISession, error) {
	var out UISession
	err := s.pool.QueryRow(ctx, `
		WITH live AS (
			SELECT id_hash, token_hash, role, expires_at FROM hipq_ui_session WHERE id_hash = $1 AND expires_at > now()
		), slid AS (
			UPDATE hipq_ui_session u SET expires_at = now() + $2::bigint * interval '1 millisecond'
			FROM live WHERE u.id_hash = live.id_hash AND live.expires_at < now() + ($2::bigint - $3::bigint) * interval '1 millisecond'
			RETURNING 1
		)
		SELECT token_hash, role FROM live`, idHash, ttl.Milliseconds(), slack.Milliseconds()).Scan(&out.TokenHash, &out.Role)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read dashboard session: %w", err)
	}
	return &out, nil
}

// UISessionDelete ends the session with idHash (sign-out, or its token no
// longer configured with its role).
func (s *Store) UISessionDelete(ctx context.Context, idHash []byte) error {
	if _, err := s.pool.Exec(ctx, `DELETE FROM hipq_ui_session WHERE id_hash = $1`, idHash); err != nil {
		return fmt.Errorf("delete dashboard session: %w", err)
	}
	return nil
}

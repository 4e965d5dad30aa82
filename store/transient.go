package store

import (
	"context"
	"errors"
	"io"
	"net"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"

	"github.com/hipq/hipq/correlator"
)

// IsTransient reports whether err may go away by itself if the same write
// is tried again later: the connection or the server failed (class 08, a
// connection that broke, a server shutting down or not yet accepting
// connections, class 57P), PostgreSQL ran out of a resource (class 53: disk
// full, too many connections, out of memory), a system error (class 58), or
// the transaction lost a race (class 40: serialization failure, deadlock).
// Without an answer from PostgreSQL, only a failed connection, network or
// pool is transient. Everything else PostgreSQL answers (a value it refuses, a constraint, a
// limit such as an index row too large, a bug in a statement) will answer
// the same way again: callers decide by this what to retry and what to set
// aside, so an error class nobody listed is never retried for ever.
//
// An ended context is not transient: the caller is stopping.
func IsTransient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	if errors.Is(err, errRaced) {
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		if len(pe.Code) != 5 {
			return false
		}
		switch pe.Code[:2] {
		case "08", "40", "53", "57", "58":
			// 57014 (query_canceled) is a statement timeout or a cancel:
			// the same write may well finish next time.
			return true
		}
		return false
	}
	// No answer from PostgreSQL: transient when the connection, the
	// network or the pool failed. Any other error (a value pgx could not
	// encode, say) would come back the same way.
	var ce *pgconn.ConnectError
	var ne net.Error
	return pgconn.SafeToRetry(err) || pgconn.Timeout(err) || errors.As(err, &ce) || errors.As(err, &ne) ||
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, puddle.ErrClosedPool) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// errRaced: a statement kept losing a race with other writers (rows
// committed under it); the same write will go through later.
var errRaced = errors.New("kept losing a race with other writers")

// maxErrorText bounds the error texts hipq stores.
const maxErrorText = 4096

// safeText makes s storable in a text column whatever it holds: PostgreSQL
// refuses NUL bytes and invalid UTF-8, and an error text may quote a
// downstream's answer byte for byte. It is cut to maxErrorText bytes.
func safeText(s string) string { return correlator.Clip(s, maxErrorText) }

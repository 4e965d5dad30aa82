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

// IsDataError reports whether err is the fault of the data written, so
// that the same write of other data would not fail this way: PostgreSQL
// refused a value (class 22, data exception), a constraint (class 23) or a
// limit a value ran into (class 54, such as an index row too large), or
// hipq refused the input itself (a correlator.InputError). Such input is
// set aside at once. Anything else PostgreSQL refuses may be the system's
// fault rather than the input's (a privilege revoked, a column renamed by
// a rollout, a trigger failing on every row): callers compare it with how
// the next input fares before they blame the input (SameRefusal).
func IsDataError(err error) bool {
	var ie *correlator.InputError
	if errors.As(err, &ie) {
		return true
	}
	c := SQLState(err)
	if len(c) != 5 {
		return false
	}
	switch c[:2] {
	case "22", "23", "54":
		return true
	}
	return false
}

// SQLState is the SQLSTATE of PostgreSQL's answer in err; "" when err
// holds none (PostgreSQL was never asked, or never answered).
func SQLState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// SameRefusal reports whether two writes, of different input, were
// refused the same way: neither for its data (IsDataError) and both with
// the same SQLSTATE class (the first two characters), or both without a
// SQLSTATE. Two inputs refused the same way in a row point at the system,
// not at either input.
func SameRefusal(a, b error) bool {
	if a == nil || b == nil || IsDataError(a) || IsDataError(b) {
		return false
	}
	ca, cb := SQLState(a), SQLState(b)
	return ca[:min(2, len(ca))] == cb[:min(2, len(cb))]
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

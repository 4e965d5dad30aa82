package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// What may pass is retried; everything else PostgreSQL (or pgx) answers
// would come back the same, so the record at fault is set aside.
func TestIsTransient(t *testing.T) {
	pg := func(code string) error { return fmt.Errorf("apply: %w", &pgconn.PgError{Code: code}) }
	for _, c := range []struct {
		err  error
		want bool
	}{
		{pg("40001"), true}, {pg("40P01"), true}, {pg("08006"), true}, {pg("57P01"), true}, {pg("57014"), true},
		{pg("53100"), true}, {pg("53300"), true}, {pg("58030"), true},
		{pg("54000"), false}, {pg("22P05"), false}, {pg("23505"), false}, {pg("42P01"), false}, {pg("XX000"), false}, {pg("P0001"), false},
		{&net.OpError{Op: "write", Err: errors.New("broken pipe")}, true},
		{fmt.Errorf("read: %w", io.ErrUnexpectedEOF), true},
		{pgconn.ErrConnClosed, true},
		{context.Canceled, false}, {context.DeadlineExceeded, false},
		{errors.New("unable to encode 1e400 into binary format for numeric"), false},
		{nil, false},
	} {
		if got := IsTransient(c.err); got != c.want {
			t.Errorf("IsTransient(%v) = %v, want %v", c.err, got, c.want)
		}
	}
	if safeText("a\x00b\xffc") != "a\uFFFDb\uFFFDc" {
		t.Errorf("safeText: %q", safeText("a\x00b\xffc"))
	}
}

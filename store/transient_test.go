package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/hipq/hipq/correlator"
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

// A refusal of the data (classes 22, 23, 54, hipq's own input errors) is
// the input's at once; any other is compared by SQLSTATE class with the
// next input's refusal.
func TestRefusalKinds(t *testing.T) {
	pg := func(code string) error { return fmt.Errorf("apply: %w", &pgconn.PgError{Code: code}) }
	for _, c := range []struct {
		err  error
		data bool
	}{
		{pg("22P05"), true}, {pg("23505"), true}, {pg("54000"), true},
		{&correlator.InputError{Code: correlator.CodeTooLarge}, true},
		{pg("42501"), false}, {pg("42703"), false}, {pg("XX000"), false}, {pg("P0001"), false},
		{errors.New("unable to encode 1e400 into binary format for numeric"), false},
	} {
		if got := IsDataError(c.err); got != c.data {
			t.Errorf("IsDataError(%v) = %v, want %v", c.err, got, c.data)
		}
	}
	for _, c := range []struct {
		a, b error
		same bool
	}{
		{pg("42501"), pg("42501"), true},
		{pg("42501"), pg("42703"), true}, // one class: syntax error or access rule violation
		{pg("XX000"), pg("XX000"), true},
		{pg("XX000"), pg("P0001"), false},
		{pg("42501"), pg("22P05"), false}, // the second record's own
		{pg("22P05"), pg("22P05"), false}, // each record's own
		{errors.New("no SQLSTATE"), errors.New("none either"), true},
		{errors.New("no SQLSTATE"), pg("XX000"), false},
		{pg("XX000"), nil, false},
	} {
		if got := SameRefusal(c.a, c.b); got != c.same {
			t.Errorf("SameRefusal(%v, %v) = %v, want %v", c.a, c.b, got, c.same)
		}
	}
	if SQLState(pg("42501")) != "42501" || SQLState(errors.New("x")) != "" {
		t.Errorf("SQLState: %q %q", SQLState(pg("42501")), SQLState(errors.New("x")))
	}
}

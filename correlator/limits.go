package correlator

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// Limits of what hipq takes in (SPEC §4). They keep every value within
// what PostgreSQL can index and store, so an input over them is refused at
// decode, naming the field and the limit, and never reaches a statement
// that would fail on it.
const (
	// MaxJobTypeBytes bounds job_type.
	MaxJobTypeBytes = 255
	// MaxJobKeyBytes bounds job_key.
	MaxJobKeyBytes = 1024
	// MaxHeaders bounds how many headers a Kafka record may carry.
	MaxHeaders = 64
	// MaxHeaderBytes bounds the names and values of a record's headers
	// together.
	MaxHeaderBytes = 64 << 10
	// MaxDetailBytes bounds the detail of an InputError (a dead letter's
	// reason), which may quote the input.
	MaxDetailBytes = 1024
)

// CheckName validates a job_type or job_key: non-empty valid UTF-8 without
// NUL, at most max bytes.
func CheckName(field, v string, max int) error {
	switch {
	case v == "":
		return inputErrorf(CodeMissingField, "%s: a non-empty string is required", field)
	case len(v) > max:
		e := inputErrorf(CodeTooLarge, "%s: %d bytes is more than the limit of %d", field, len(v), max)
		e.Field = field
		return e
	case !utf8.ValidString(v):
		return inputErrorf(CodeInvalidUTF8, "%s: not valid UTF-8", field)
	case strings.IndexByte(v, 0) >= 0:
		return inputErrorf(CodeNullChar, "%s: contains a NUL character", field)
	}
	return nil
}

// CheckJobName validates a job type and key against their limits.
func CheckJobName(jobType, jobKey string) error {
	if err := CheckName("job_type", jobType, MaxJobTypeBytes); err != nil {
		return err
	}
	return CheckName("job_key", jobKey, MaxJobKeyBytes)
}

// CheckHeaders refuses a record with more headers, or more header bytes,
// than the limits.
func CheckHeaders(hs []Header) error {
	if len(hs) > MaxHeaders {
		return inputErrorf(CodeTooLarge, "headers: %d headers is more than the limit of %d", len(hs), MaxHeaders)
	}
	n := 0
	for _, h := range hs {
		n += len(h.Key) + len(h.Value)
	}
	if n > MaxHeaderBytes {
		return inputErrorf(CodeTooLarge, "headers: %d bytes is more than the limit of %d", n, MaxHeaderBytes)
	}
	return nil
}

// Clip cuts s to at most n bytes (on a rune boundary), marking the cut,
// and makes it valid UTF-8 without NUL: fit for a log line or a text
// column whatever it quotes.
func Clip(s string, n int) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	if strings.IndexByte(s, 0) >= 0 {
		s = strings.ReplaceAll(s, "\x00", "\uFFFD")
	}
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + fmt.Sprintf("… (%d bytes in all)", len(s))
}

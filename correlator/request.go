package correlator

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"reflect"
	"strings"
	"time"
	"unicode/utf8"
)

// Codes of InputError, the first word of a dead letter's reason.
const (
	CodeInvalidJSON    = "invalid_json"
	CodeNotObject      = "not_object"
	CodeUnknownField   = "unknown_field"
	CodeMissingField   = "missing_field"
	CodeInvalidField   = "invalid_field"
	CodeUnknownJobType = "unknown_job_type"
	CodeConflict       = "conflict"
	CodeTooLarge       = "too_large"
	CodeTooDeep        = "too_deep"
	CodeInvalidUTF8    = "invalid_utf8"
	CodeNullChar       = "null_character"
	CodeNoJob          = "no_job"
	CodeNewerAttempt   = "newer_attempt"
	CodeMismatch       = "mismatch"
	CodeRejected       = "rejected"
	// CodeSchemaViolation: job_data fails its type's data_schema.
	CodeSchemaViolation = "schema_violation"
)

// MaxDepth is how deeply a message may nest from its root.
const MaxDepth = 64

// InputError is why an input (intake record, reply, HTTP body) cannot be
// used. Its text, "code: detail", is the dead letter's reason.
type InputError struct {
	Code   string
	Detail string
	// Field names the field at fault when one is (a value of it too
	// large, say), rather than the whole input.
	Field string
}

func (e *InputError) Error() string { return e.Code + ": " + e.Detail }

func inputErrorf(code, format string, args ...any) *InputError {
	return &InputError{Code: code, Detail: Clip(fmt.Sprintf(format, args...), MaxDetailBytes)}
}

// Request is a decoded intake record (SPEC §4).
type Request struct {
	JobType          string          `json:"job_type"`
	JobKey           string          `json:"job_key"`
	JobData          json.RawMessage `json:"job_data,omitempty"`
	ScheduledRunTime *time.Time      `json:"scheduled_run_time,omitempty"`
	Priority         *int            `json:"priority,omitempty"`
	TimeoutSeconds   *int            `json:"timeout_seconds,omitempty"`
	ThrottleFactor   *int            `json:"throttle_factor,omitempty"`
	TimeWindows      []TimeWindow    `json:"time_windows,omitempty"`
	ExpiresAt        *time.Time      `json:"expires_at,omitempty"`
}

// CheckJSON verifies what PostgreSQL's jsonb and hipq demand of any JSON
// input: at most maxBytes (0 = no limit), valid UTF-8, well-formed, nested
// at most MaxDepth deep, and no NUL character in any string or key.
func CheckJSON(b []byte, maxBytes int) error {
	if maxBytes > 0 && len(b) > maxBytes {
		return inputErrorf(CodeTooLarge, "%d bytes is more than the limit of %d", len(b), maxBytes)
	}
	_, err := checkJSON(b)
	return err
}

// checkJSON is CheckJSON but the size, and says whether b is one value
// json.Valid takes (not a stream of several, which the token walk allows).
func checkJSON(b []byte) (valid bool, err error) {
	if !utf8.Valid(b) {
		return false, inputErrorf(CodeInvalidUTF8, "the value is not valid UTF-8")
	}
	if json.Valid(b) {
		return true, checkShape(b) // the common case: one pass, no allocation
	}
	return false, checkTokens(b) // says where and why, as encoding/json words it
}

// checkShape applies CheckJSON's depth and NUL rules to well-formed JSON
// (json.Valid), in the order checkTokens meets them: an opening bracket
// past MaxDepth, or a \u0000 escape in a string or a key.
func checkShape(b []byte) error {
	depth := 0
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '{', '[':
			if depth++; depth > MaxDepth {
				return inputErrorf(CodeTooDeep, "nested deeper than %d", MaxDepth)
			}
		case '}', ']':
			depth--
		case '"':
			for i++; b[i] != '"'; i++ {
				if b[i] != '\\' {
					continue
				}
				i++ // the escaped byte; valid JSON has all of an escape
				if b[i] == 'u' && string(b[i+1:i+5]) == "0000" {
					return inputErrorf(CodeNullChar, "a string holds \\u0000, which PostgreSQL cannot store")
				}
			}
		}
	}
	return nil
}

// checkTokens is CheckJSON token by token: slow, but it names the fault.
func checkTokens(b []byte) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	depth := 0
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			return inputErrorf(CodeInvalidJSON, "%v", err)
		}
		switch t := tok.(type) {
		case json.Delim:
			if t == '{' || t == '[' {
				depth++
				if depth > MaxDepth {
					return inputErrorf(CodeTooDeep, "nested deeper than %d", MaxDepth)
				}
			} else {
				depth--
			}
		case string:
			if strings.IndexByte(t, 0) >= 0 {
				return inputErrorf(CodeNullChar, "a string holds \\u0000, which PostgreSQL cannot store")
			}
		}
	}
	if depth != 0 || dec.InputOffset() == 0 {
		return inputErrorf(CodeInvalidJSON, "unexpected end of JSON input")
	}
	return nil
}

// DecodeRequest decodes and validates an intake record's value. Errors are
// *InputError.
func DecodeRequest(b []byte, maxBytes int) (*Request, error) {
	if err := CheckJSON(b, maxBytes); err != nil {
		return nil, err
	}
	if t := bytes.TrimLeft(b, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		return nil, inputErrorf(CodeNotObject, "the value must be a JSON object")
	}
	req, ok := decodePlain(b)
	if !ok {
		if err := checkFields(b, requestFields); err != nil {
			return nil, err
		}
		if err := json.Unmarshal(b, &req); err != nil {
			return nil, fieldError(err)
		}
	}
	if err := req.validate(); err != nil {
		return nil, err
	}
	return &req, nil
}

func (r *Request) validate() error {
	if err := CheckJobName(r.JobType, r.JobKey); err != nil {
		return err
	}
	for _, f := range [...]struct {
		name string
		v    *int
	}{{"priority", r.Priority}, {"timeout_seconds", r.TimeoutSeconds}, {"throttle_factor", r.ThrottleFactor}} {
		if f.v != nil && (*f.v > math.MaxInt32 || *f.v < math.MinInt32) {
			return inputErrorf(CodeInvalidField, "%s: %d is out of range (32-bit integer)", f.name, *f.v)
		}
	}
	if r.TimeoutSeconds != nil && *r.TimeoutSeconds <= 0 {
		return inputErrorf(CodeInvalidField, "timeout_seconds: must be positive, got %d", *r.TimeoutSeconds)
	}
	if r.ThrottleFactor != nil && *r.ThrottleFactor < 1 {
		return inputErrorf(CodeInvalidField, "throttle_factor: must be at least 1, got %d", *r.ThrottleFactor)
	}
	if r.TimeWindows != nil {
		if err := CompileWindows(r.TimeWindows); err != nil {
			return inputErrorf(CodeInvalidField, "%v", err)
		}
	}
	return nil
}

var requestFields = fieldSet(Request{})

// decodePlain decodes the request most producers send, in one pass and
// without reflection: an object (well-formed: CheckJSON passed) whose keys
// are only job_type, job_key and job_data, none escaped, the first two
// unescaped strings. Anything else is not ok and goes the general way
// (checkFields and encoding/json), which also words every error; on what
// it takes, decodePlain agrees with that way (FuzzDecodePlain).
func decodePlain(b []byte) (req Request, ok bool) {
	ok = eachMember(b, func(key string, v []byte) bool {
		switch key {
		case "job_type", "job_key":
			if v[0] != '"' {
				return false
			}
			s, end, plain := plainString(v, 0)
			if !plain || end != len(v) {
				return false
			}
			if key == "job_type" {
				req.JobType = s
			} else {
				req.JobKey = s
			}
		case "job_data":
			req.JobData = bytes.Clone(v)
		default:
			return false
		}
		return true
	})
	return req, ok
}

// eachMember calls f with each member of the object b (well-formed: CheckJSON
// passed), in order: its key and its value's JSON text. It is false when b is
// not an object, a key holds an escape, f says false, or data trails the
// object (a stream of values: the general way refuses it).
func eachMember(b []byte, f func(key string, v []byte) bool) bool {
	i := skipSpace(b, 0)
	if i == len(b) || b[i] != '{' {
		return false
	}
	for i++; ; {
		i = skipSpace(b, i)
		switch b[i] {
		case '}':
			return skipSpace(b, i+1) == len(b)
		case ',':
			i = skipSpace(b, i+1)
		}
		key, end, plain := plainString(b, i)
		if !plain {
			return false
		}
		i = skipSpace(b, skipSpace(b, end)+1) // past ':'
		end = skipValue(b, i)
		if !f(key, b[i:end]) {
			return false
		}
		i = end
	}
}

// plainString reads the string starting at b[i] ('"') of well-formed JSON:
// its text and the index past it; plain is false when it holds an escape.
func plainString(b []byte, i int) (s string, end int, plain bool) {
	for j := i + 1; ; j++ {
		switch b[j] {
		case '"':
			return string(b[i+1 : j]), j + 1, true
		case '\\':
			return "", 0, false
		}
	}
}

// skipValue returns the index past the value starting at b[i] of
// well-formed JSON.
func skipValue(b []byte, i int) int {
	depth := 0
	for ; i < len(b); i++ {
		switch b[i] {
		case '"':
			for i++; b[i] != '"'; i++ {
				if b[i] == '\\' {
					i++
				}
			}
			if depth == 0 {
				return i + 1
			}
		case '{', '[':
			depth++
		case '}', ']':
			if depth--; depth == 0 {
				return i + 1
			}
			if depth < 0 {
				return i
			}
		case ',', ' ', '\t', '\r', '\n':
			if depth == 0 {
				return i
			}
		}
	}
	return i
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\r' || b[i] == '\n') {
		i++
	}
	return i
}

// fieldSet lists the JSON names of a struct's fields.
func fieldSet(v any) map[string]bool {
	t := reflect.TypeOf(v)
	set := make(map[string]bool, t.NumField())
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		set[name] = true
	}
	return set
}

// checkFields refuses a top-level key that is not one of known, so that a
// typo never passes silently. encoding/json reports unknown fields only as
// text, so the keys are checked here instead.
func checkFields(b []byte, known map[string]bool) error {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return fieldError(err)
	}
	for k := range raw {
		if !known[k] {
			return inputErrorf(CodeUnknownField, "%q is not a field of this message", k)
		}
	}
	return nil
}

// fieldError turns encoding/json's errors into InputErrors naming the field.
func fieldError(err error) error {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	var pe *time.ParseError
	switch {
	case errors.As(err, &te):
		return inputErrorf(CodeInvalidField, "%s: want %s, got %s", te.Field, te.Type, te.Value)
	case errors.As(err, &se):
		return inputErrorf(CodeInvalidJSON, "%v", err)
	case errors.As(err, &pe):
		return inputErrorf(CodeInvalidField, "a time is not RFC 3339: %v", err)
	}
	return inputErrorf(CodeInvalidField, "%v", err)
}

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
	if !utf8.Valid(b) {
		return inputErrorf(CodeInvalidUTF8, "the value is not valid UTF-8")
	}
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
	if err := checkFields(b, requestFields); err != nil {
		return nil, err
	}
	var req Request
	if err := json.Unmarshal(b, &req); err != nil {
		return nil, fieldError(err)
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
	for name, v := range map[string]*int{"priority": r.Priority, "timeout_seconds": r.TimeoutSeconds, "throttle_factor": r.ThrottleFactor} {
		if v != nil && (*v > math.MaxInt32 || *v < math.MinInt32) {
			return inputErrorf(CodeInvalidField, "%s: %d is out of range (32-bit integer)", name, *v)
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

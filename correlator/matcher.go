package correlator

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Header is one record header.
type Header struct {
	Key   string
	Value []byte
}

// Record is what a matcher reads: a Kafka record's key, value and headers,
// or an HTTP body and its fields.
type Record struct {
	Key     []byte
	Value   []byte
	Headers []Header
}

// Header returns the last value of the header named key (case-insensitive).
func (r *Record) Header(key string) ([]byte, bool) {
	for i := len(r.Headers) - 1; i >= 0; i-- {
		if strings.EqualFold(r.Headers[i].Key, key) {
			return r.Headers[i].Value, true
		}
	}
	return nil, false
}

// Field says where a matcher finds one field. Exactly one of its members is
// set.
type Field struct {
	Header    string  `yaml:"header,omitempty" json:"header,omitempty"`
	JSON      string  `yaml:"json,omitempty" json:"json,omitempty"` // a JSON pointer into the value
	RecordKey bool    `yaml:"record_key,omitempty" json:"record_key,omitempty"`
	Value     *string `yaml:"value,omitempty" json:"value,omitempty"` // a constant
}

// IsZero reports whether the field names no source.
func (f Field) IsZero() bool { return f.Header == "" && f.JSON == "" && !f.RecordKey && f.Value == nil }

// Validate checks that exactly one source is named.
func (f Field) Validate() error {
	n := 0
	for _, set := range []bool{f.Header != "", f.JSON != "", f.RecordKey, f.Value != nil} {
		if set {
			n++
		}
	}
	if n != 1 {
		return fmt.Errorf("name exactly one of header, json, record_key, value")
	}
	if f.JSON != "" && !strings.HasPrefix(f.JSON, "/") {
		return fmt.Errorf("json: %q is not a JSON pointer (it must start with /)", f.JSON)
	}
	return nil
}

// Header names used on requests and read from replies by default.
const (
	HeaderJobType = "hipq-job-type"
	HeaderJobKey  = "hipq-job-key"
	HeaderAttempt = "hipq-attempt"
	HeaderJobID   = "hipq-job-id"
	HeaderReplyTo = "hipq-reply-to"
	HeaderError   = "hipq-error"
)

// Matcher extracts a Reply from a record.
type Matcher struct {
	JobID   Field
	JobType Field
	JobKey  Field
	Attempt Field
	Status  Field
	Success []string
	Failure []string
	// Progress values mark news of a running attempt, not its end.
	Progress  []string
	Retryable Field
	Error     Field
	// RetryAfter: seconds or a time before which a failure's retry may
	// not run.
	RetryAfter Field
	Result     Field // zero: the whole value
	MaxBytes   int   // 0: no limit
}

// DefaultMatcher reads the hipq-* headers that requests carry, so a
// responder that copies them onto its reply needs no configuration.
func DefaultMatcher() Matcher {
	return Matcher{
		JobID:      Field{Header: HeaderJobID},
		JobType:    Field{Header: HeaderJobType},
		JobKey:     Field{Header: HeaderJobKey},
		Attempt:    Field{Header: HeaderAttempt},
		Status:     Field{JSON: "/status"},
		Success:    []string{"succeeded", "success", "ok"},
		Failure:    []string{"failed", "failure", "error"},
		Progress:   []string{"progress"},
		Retryable:  Field{JSON: "/retryable"},
		Error:      Field{JSON: "/error"},
		RetryAfter: Field{JSON: "/retry_after"},
		MaxBytes:   1 << 20,
	}
}

type extracted struct {
	rec    *Record
	isJSON bool
	// top holds the value's top-level members (their JSON text) when it
	// is one object with unescaped keys: pointers of one token read them
	// without decoding the whole value; any other pointer decodes doc.
	top     map[string][]byte
	doc     any
	decoded bool
}

// value returns the decoded value, decoding it on first use.
func (x *extracted) value() any {
	if !x.decoded {
		x.decoded = true
		dec := json.NewDecoder(bytes.NewReader(x.rec.Value))
		dec.UseNumber()
		_ = dec.Decode(&x.doc) // CheckJSON passed: it decodes
	}
	return x.doc
}

// topMembers returns the members of b, one well-formed JSON value, when it
// is an object whose keys hold no escape (a later member of the same name
// wins, as when decoding); ok is false otherwise.
func topMembers(b []byte) (top map[string][]byte, ok bool) {
	top = map[string][]byte{}
	ok = eachMember(b, func(key string, v []byte) bool { top[key] = v; return true })
	return top, ok
}

// member reads a one-token pointer from the top-level members, as pointer
// and lookup would from the decoded value; ok is false when it cannot.
func (x *extracted) member(p string) (text string, raw json.RawMessage, found, ok bool) {
	if x.top == nil || strings.ContainsAny(p[1:], "/~") {
		return "", nil, false, false // (a pointer of more tokens, or escaped: decoded)
	}
	v, found := x.top[p[1:]]
	switch {
	case !found:
		return "", nil, false, true
	case v[0] == '"':
		var s string
		if _, end, plain := plainString(v, 0); plain && end == len(v) {
			s = string(v[1 : len(v)-1])
		} else if json.Unmarshal(v, &s) != nil {
			return "", nil, false, false
		}
		return s, nil, true, true // (raw: what result makes of the text, as it is)
	case v[0] == '{' || v[0] == '[':
		return "", nil, false, false // re-encoded from the decoded value
	}
	return string(v), json.RawMessage(v), true, true // a number, true, false or null: as written
}

// lookup returns the field's raw text (JSON values as their JSON text, but
// strings unquoted) and whether it was present.
func (x *extracted) lookup(f Field) (text string, raw json.RawMessage, ok bool) {
	switch {
	case f.Header != "":
		v, ok := x.rec.Header(f.Header)
		return string(v), nil, ok
	case f.RecordKey:
		return string(x.rec.Key), nil, x.rec.Key != nil
	case f.Value != nil:
		return *f.Value, nil, true
	case f.JSON != "":
		if !x.isJSON {
			return "", nil, false
		}
		if text, raw, found, ok := x.member(f.JSON); ok {
			return text, raw, found
		}
		v, ok := pointer(x.value(), f.JSON)
		if !ok {
			return "", nil, false
		}
		raw, _ := json.Marshal(v)
		if s, isStr := v.(string); isStr {
			return s, raw, true
		}
		return string(raw), raw, true
	}
	return "", nil, false
}

// PointerTokens splits a non-empty RFC 6901 JSON pointer into its
// unescaped reference tokens.
func PointerTokens(p string) []string {
	toks := strings.Split(p[1:], "/")
	for i, t := range toks {
		toks[i] = strings.ReplaceAll(strings.ReplaceAll(t, "~1", "/"), "~0", "~")
	}
	return toks
}

// pointer resolves an RFC 6901 JSON pointer.
func pointer(doc any, p string) (any, bool) {
	if p == "" {
		return doc, true
	}
	for _, tok := range PointerTokens(p) {
		switch d := doc.(type) {
		case map[string]any:
			v, ok := d[tok]
			if !ok {
				return nil, false
			}
			doc = v
		case []any:
			i, err := strconv.Atoi(tok)
			if err != nil || i < 0 || i >= len(d) {
				return nil, false
			}
			doc = d[i]
		default:
			return nil, false
		}
	}
	return doc, true
}

// Match extracts the reply. Errors are *InputError: the reply is to be
// dead-lettered.
func (m *Matcher) Match(rec *Record) (*Reply, error) { return m.match(rec, true) }

// match is Match; members false decodes the whole value for every pointer
// (the tests' reference for the one-pass reading of top-level members).
func (m *Matcher) match(rec *Record, members bool) (*Reply, error) {
	if m.MaxBytes > 0 && len(rec.Value) > m.MaxBytes {
		return nil, inputErrorf(CodeTooLarge, "%d bytes is more than the limit of %d", len(rec.Value), m.MaxBytes)
	}
	x := &extracted{rec: rec}
	if valid, err := checkJSON(rec.Value); err == nil {
		x.isJSON = true // (well-formed: it decodes)
		if members && valid {
			if top, ok := topMembers(rec.Value); ok {
				x.top = top
			}
		}
	} else if ie := err.(*InputError); ie.Code != CodeInvalidJSON {
		// Valid JSON that PostgreSQL cannot store, or text that is not UTF-8.
		return nil, ie
	} else if bytes.IndexByte(rec.Value, 0) >= 0 {
		return nil, inputErrorf(CodeNullChar, "the value holds a NUL byte, which PostgreSQL cannot store")
	}
	r := &Reply{Retryable: true, Success: true}
	if s, _, ok := x.lookup(m.JobID); ok {
		id, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil || id <= 0 {
			return nil, inputErrorf(CodeInvalidField, "job_id: %q is not a job id", s)
		}
		r.JobID = &id
	}
	r.JobType, _, _ = x.lookup(m.JobType)
	r.JobKey, _, _ = x.lookup(m.JobKey)
	if r.JobID == nil && (r.JobType == "" || r.JobKey == "") {
		return nil, inputErrorf(CodeMissingField, "job_type and job_key: a reply without a job id must carry both")
	}
	if r.JobID == nil || r.JobType != "" || r.JobKey != "" {
		for _, f := range []struct {
			name, v string
			max     int
		}{{"job_type", r.JobType, MaxJobTypeBytes}, {"job_key", r.JobKey, MaxJobKeyBytes}} {
			if f.v == "" && r.JobID != nil {
				continue
			}
			if err := CheckName(f.name, f.v, f.max); err != nil {
				return nil, err
			}
		}
	}
	if s, _, ok := x.lookup(m.Attempt); ok {
		a, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || a < 1 {
			return nil, inputErrorf(CodeInvalidField, "attempt: %q is not a positive integer", s)
		}
		r.Attempt = &a
	}
	if s, _, ok := x.lookup(m.Status); ok {
		switch {
		case slices.Contains(m.Success, s):
		case slices.Contains(m.Failure, s):
			r.Success = false
		case slices.Contains(m.Progress, s):
			r.Progress = true
		default:
			return nil, inputErrorf(CodeInvalidField, "status: %q is neither a success (%s), a failure (%s) nor a progress (%s) value",
				s, strings.Join(m.Success, ", "), strings.Join(m.Failure, ", "), strings.Join(m.Progress, ", "))
		}
	}
	if s, _, ok := x.lookup(m.Retryable); ok && s != "null" {
		b, err := strconv.ParseBool(s)
		if err != nil {
			return nil, inputErrorf(CodeInvalidField, "retryable: %q is not a boolean", s)
		}
		r.Retryable = b
	}
	if s, _, ok := x.lookup(m.Error); ok && s != "null" {
		r.Error = s
	}
	if s, _, ok := x.lookup(m.RetryAfter); ok && s != "null" {
		ra, valid := ParseRetryAfter(s)
		if !valid {
			return nil, inputErrorf(CodeInvalidField, "retry_after: %q is neither seconds nor a time", Clip(s, 64))
		}
		r.RetryAfter = ra
	}
	r.Result = m.result(x)
	return r, nil
}

func (m *Matcher) result(x *extracted) json.RawMessage {
	if m.Result.IsZero() {
		if x.isJSON {
			return json.RawMessage(bytes.TrimSpace(x.rec.Value))
		}
		s, _ := json.Marshal(string(x.rec.Value))
		return s
	}
	text, raw, ok := x.lookup(m.Result)
	switch {
	case !ok:
		return json.RawMessage("null")
	case raw != nil:
		return raw
	}
	s, _ := json.Marshal(text)
	return s
}

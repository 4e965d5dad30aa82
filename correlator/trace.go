package correlator

import "strings"

// Trace context headers (W3C Trace Context), read from intake records,
// outbox rows and API calls, and written on requests.
const (
	HeaderTraceParent = "traceparent"
	HeaderTraceState  = "tracestate"
)

// TraceContext is a W3C trace context as hipq keeps it with a job: the
// traceparent and tracestate texts.
type TraceContext struct {
	Parent string
	State  string
}

// IsZero reports whether there is no trace context.
func (t TraceContext) IsZero() bool { return t.Parent == "" }

// TraceContextOf reads the trace context of an input's headers. An absent
// or invalid traceparent is no context, and a tracestate that is not
// printable ASCII is dropped: a trace context is never a reason to refuse
// the input, and what is kept is always text PostgreSQL stores. A
// traceparent of a future version keeps its first 55 bytes, the fields
// W3C Trace Context level 1 reads: what follows them may be any bytes (a
// NUL, invalid UTF-8) and no reader of this level uses it. A tracestate
// without a valid traceparent is dropped with it.
func TraceContextOf(headers []Header) TraceContext {
	r := Record{Headers: headers}
	p, ok := r.Header(HeaderTraceParent)
	if !ok || !ValidTraceParent(string(p)) {
		return TraceContext{}
	}
	tc := TraceContext{Parent: string(p[:traceParentLen])}
	if s, ok := r.Header(HeaderTraceState); ok && len(s) <= 512 && validText(string(s)) {
		tc.State = string(s)
	}
	return tc
}

// traceParentLen is the length of a version 00 traceparent, the part of
// any version that W3C Trace Context level 1 reads.
const traceParentLen = 55

// ValidTraceParent checks a traceparent as W3C Trace Context level 1
// reads it: version-traceid-parentid-flags in lowercase hex, version not
// ff, ids not all zero; a future version may carry more after the flags.
func ValidTraceParent(s string) bool {
	if len(s) < traceParentLen || (len(s) > traceParentLen && (s[:2] == "00" || s[traceParentLen] != '-')) {
		return false
	}
	parts := strings.SplitN(s[:traceParentLen], "-", 4)
	if len(parts) != 4 || len(parts[0]) != 2 || len(parts[1]) != 32 || len(parts[2]) != 16 || len(parts[3]) != 2 {
		return false
	}
	for _, p := range parts {
		if !lowerHex(p) {
			return false
		}
	}
	return parts[0] != "ff" && strings.Trim(parts[1], "0") != "" && strings.Trim(parts[2], "0") != ""
}

func lowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// validText: printable ASCII, as tracestate is.
func validText(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

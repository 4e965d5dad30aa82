package store

import (
	"encoding/base64"
	"encoding/json"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/hipq/hipq/correlator"
)

// Source is where an input came from: a Kafka record, or an HTTP call (no
// topic).
type Source struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []correlator.Header
	Received  time.Time
}

// DeadLetter is an input hipq could not use.
type DeadLetter struct {
	ID       int64
	Kind     string // intake, outbox, reply, callback
	Source   Source
	Reason   string // "code: detail"
	Replayed *time.Time
}

// Dead-letter sources.
const (
	SourceIntake   = "intake"
	SourceReply    = "reply"
	SourceCallback = "callback"
	SourceOutbox   = "outbox" // a row of hipq_intake
)

// OffsetAdvance moves one partition's stored offset from From (-1: none
// stored yet) to To, the offset after the last record applied.
type OffsetAdvance struct {
	Topic     string
	Partition int32
	From      int64
	To        int64
}

// TopicPartition names a partition.
type TopicPartition struct {
	Topic     string
	Partition int32
}

// SensitiveHeader reports whether a header must not be kept, in
// hipq_dead_letter or any copy of it: credentials.
func SensitiveHeader(key string) bool {
	k := strings.ToLower(key)
	switch k {
	case "authorization", "proxy-authorization", "cookie", "x-api-key":
		return true
	}
	return strings.Contains(k, "token") || strings.Contains(k, "secret") || strings.Contains(k, "password")
}

// headerJSON is one header as hipq_dead_letter.headers and
// hipq_early_reply.headers keep it: the name as text, the value base64.
// A name that is not text PostgreSQL can store (a NUL, invalid UTF-8) is
// kept base64 in key_base64 instead, so any record's headers can be kept
// byte for byte.
type headerJSON struct {
	Key       string `json:"key,omitempty"`
	KeyBase64 string `json:"key_base64,omitempty"`
	Value     string `json:"value"`
}

// headersJSON encodes headers in record order, values base64, dropping the
// sensitive ones.
func headersJSON(hs []correlator.Header) string {
	out := make([]headerJSON, 0, len(hs))
	for _, h := range hs {
		if SensitiveHeader(h.Key) {
			continue
		}
		hj := headerJSON{Key: h.Key, Value: base64.StdEncoding.EncodeToString(h.Value)}
		if !utf8.ValidString(h.Key) || strings.IndexByte(h.Key, 0) >= 0 {
			hj.Key, hj.KeyBase64 = "", base64.StdEncoding.EncodeToString([]byte(h.Key))
		}
		out = append(out, hj)
	}
	b, _ := json.Marshal(out)
	return string(b)
}

func decodeHeaders(b []byte) []correlator.Header {
	var hs []headerJSON
	_ = json.Unmarshal(b, &hs)
	out := make([]correlator.Header, 0, len(hs))
	for _, h := range hs {
		v, _ := base64.StdEncoding.DecodeString(h.Value)
		k := h.Key
		if h.KeyBase64 != "" {
			kb, _ := base64.StdEncoding.DecodeString(h.KeyBase64)
			k = string(kb)
		}
		out = append(out, correlator.Header{Key: k, Value: v})
	}
	return out
}

func nullable[T comparable](v T) *T {
	var zero T
	if v == zero {
		return nil
	}
	return &v
}

// decodeWindows reads a time_windows column: nil when NULL (the type's
// apply), else the compiled windows; one this build cannot evaluate is
// open all day, and the error says why.
func decodeWindows(b []byte) ([]correlator.TimeWindow, error) {
	if b == nil {
		return nil, nil
	}
	var ws []correlator.TimeWindow
	if err := json.Unmarshal(b, &ws); err != nil {
		// Its own windows, unreadable: open all day, as the claim takes
		// them; never the type's instead.
		return []correlator.TimeWindow{}, err
	}
	return ws, correlator.CompileStored(ws)
}

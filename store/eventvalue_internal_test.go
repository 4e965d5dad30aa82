package store

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// The value the relay writes is the JSON encoding/json would write of the
// same fields: every string escaped as it would be (control characters,
// quotes, backslashes, U+2028, invalid UTF-8), the result as it is, the
// times in RFC 3339, in UTC.
func TestEventValueIsJSON(t *testing.T) {
	msg := "boom"
	at := time.Date(2026, 11, 21, 10, 0, 0, 120000000, time.FixedZone("CET", 3600))
	for _, s := range []string{"", "plain", `quo"te`, `back\slash`, "new\nline\ttab\r", "\x00\x01\x1f\x7f", "é ü 漢字 🎉",
		"line\u2028sep\u2029", "bad \xff\xfe utf8", "<&>", strings.Repeat("k", 300)} {
		v := eventValue{JobType: s, JobKey: s + "!", JobID: 1 << 50, Attempt: 3, State: "final", Outcome: "failed",
			Result: []byte(`{"a": [1, 2.5, "x"], "b": null}`), Error: &msg, CreatedAt: at, FinishedAt: at.Add(time.Microsecond)}
		b := v.appendJSON(nil)
		var got map[string]any
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("%q: %s is not JSON: %v", s, b, err)
		}
		want, _ := json.Marshal(s) // (encoding/json's escapes, HTML's aside)
		var wantS string
		_ = json.Unmarshal(want, &wantS)
		result, _ := json.Marshal(got["result"])
		if got["job_type"] != wantS || got["job_key"] != wantS+"!" || got["job_id"] != float64(1<<50) || got["attempt"] != 3.0 ||
			got["state"] != "final" || got["outcome"] != "failed" || string(result) != `{"a":[1,2.5,"x"],"b":null}` || got["error"] != msg ||
			got["created_at"] != "2026-11-21T09:00:00.12Z" || got["finished_at"] != "2026-11-21T09:00:00.120001Z" || len(got) != 10 {
			t.Errorf("%q: got %v from %s", s, got, b)
		}
		if strings.ContainsRune(string(b), '\u2028') {
			t.Errorf("%q: U+2028 left unescaped in %s", s, b)
		}
	}
	v := eventValue{JobType: "t", JobKey: "k", State: "final", Outcome: "expired", CreatedAt: at, FinishedAt: at}
	var m map[string]any
	if err := json.Unmarshal(v.appendJSON(nil), &m); err != nil || m["result"] != nil || m["error"] != nil || len(m) != 10 {
		t.Errorf("no result, no error: %v, %v; want both null among 10 fields", m, err)
	}
}

func BenchmarkEventValue(b *testing.B) {
	msg := "boom"
	v := eventValue{JobType: "bench.noop", JobKey: "job-123456", JobID: 123456, Attempt: 1, State: "final", Outcome: "succeeded",
		Result: []byte(`{"ok": true}`), Error: &msg, CreatedAt: time.Now(), FinishedAt: time.Now()}
	b.ReportAllocs()
	for b.Loop() {
		_ = v.appendJSON(make([]byte, 0, 256))
	}
}

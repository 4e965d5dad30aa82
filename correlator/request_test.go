package correlator

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// TestDecodeRequestBadInput covers every bad-input case of SPEC §4.
func TestDecodeRequestBadInput(t *testing.T) {
	deep := strings.Repeat(`[`, 64) + strings.Repeat(`]`, 64)
	tooDeep := strings.Repeat(`[`, 65) + strings.Repeat(`]`, 65)
	tests := []struct {
		name  string
		value string
		code  string // "" = accepted
	}{
		{"minimal", `{"job_type":"t","job_key":"k"}`, ""},
		{"full", `{"job_type":"t","job_key":"k","job_data":{"a":[1,2]},"scheduled_run_time":"2026-11-21T10:00:00Z","priority":5,
			"timeout_seconds":60,"throttle_factor":2,"time_windows":[{"start":"05:00","end":"07:00","tz":"Europe/Berlin"}],
			"expires_at":"2026-11-22T00:00:00Z"}`, ""},
		{"job_data any value", `{"job_type":"t","job_key":"k","job_data":"text"}`, ""},
		{"nested 64 deep", `{"job_type":"t","job_key":"k","job_data":` + deep[1:len(deep)-1] + `}`, ""},
		{"not JSON", `not json`, CodeInvalidJSON},
		{"truncated", `{"job_type":"t"`, CodeInvalidJSON},
		{"empty", ``, CodeInvalidJSON},
		{"trailing data", `{"job_type":"t","job_key":"k"} {}`, CodeInvalidJSON},
		{"not an object", `["job_type"]`, CodeNotObject},
		{"string", `"hello"`, CodeNotObject},
		{"missing job_type", `{"job_key":"k"}`, CodeMissingField},
		{"missing job_key", `{"job_type":"t"}`, CodeMissingField},
		{"empty job_key", `{"job_type":"t","job_key":""}`, CodeMissingField},
		{"ill-typed job_key", `{"job_type":"t","job_key":5}`, CodeInvalidField},
		{"ill-typed priority", `{"job_type":"t","job_key":"k","priority":"high"}`, CodeInvalidField},
		{"fractional priority", `{"job_type":"t","job_key":"k","priority":1.5}`, CodeInvalidField},
		{"bad time", `{"job_type":"t","job_key":"k","scheduled_run_time":"tomorrow"}`, CodeInvalidField},
		{"priority out of range", `{"job_type":"t","job_key":"k","priority":3000000000}`, CodeInvalidField},
		{"zero timeout", `{"job_type":"t","job_key":"k","timeout_seconds":0}`, CodeInvalidField},
		{"zero throttle factor", `{"job_type":"t","job_key":"k","throttle_factor":0}`, CodeInvalidField},
		{"bad window", `{"job_type":"t","job_key":"k","time_windows":[{"start":"25:00","end":"07:00"}]}`, CodeInvalidField},
		{"bad zone", `{"job_type":"t","job_key":"k","time_windows":[{"start":"01:00","end":"07:00","tz":"Mars/Base"}]}`, CodeInvalidField},
		{"unknown field (typo)", `{"job_type":"t","job_kye":"k"}`, CodeUnknownField},
		{"too deep", `{"job_type":"t","job_key":"k","job_data":` + tooDeep + `}`, CodeTooDeep},
		{"invalid UTF-8", "{\"job_type\":\"t\",\"job_key\":\"k\xff\"}", CodeInvalidUTF8},
		{"escaped NUL", `{"job_type":"t","job_key":"k","job_data":{"a":"x\u0000y"}}`, CodeNullChar},
		{"escaped NUL in a key", `{"job_type":"t","job_key":"k","job_data":{"a\u0000":1}}`, CodeNullChar},
		{"escaped backslash then u0000 is text", `{"job_type":"t","job_key":"k","job_data":"\\u0000"}`, ""},
		{"too large", `{"job_type":"t","job_key":"k","job_data":"` + strings.Repeat("x", 400) + `"}`, CodeTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeRequest([]byte(tt.value), 300)
			if tt.code == "" {
				if err != nil {
					t.Fatalf("rejected: %v", err)
				}
				return
			}
			var ie *InputError
			if !errors.As(err, &ie) || ie.Code != tt.code {
				t.Fatalf("got %v, want code %s", err, tt.code)
			}
			if !strings.HasPrefix(err.Error(), tt.code+": ") {
				t.Errorf("reason %q does not start with its code", err)
			}
		})
	}
}

func TestNewJobDefaultsAndLimits(t *testing.T) {
	jt := &JobType{Name: "t", Queue: "q", Timeout: 10 * time.Minute, Priority: 100, ThrottleFactor: 1,
		Retry: &Backoff{Attempts: 4}, QueueLimit: 3}
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	req, _ := DecodeRequest([]byte(`{"job_type":"t","job_key":"k"}`), 0)
	j, err := NewJob(req, jt, now)
	if err != nil {
		t.Fatal(err)
	}
	// Due at once, with no windows: the zero time stands for the database's
	// now() at the insert (one clock, the claim's).
	if j.Queue != "q" || j.Priority != 100 || j.TimeoutSeconds != 600 || j.MaxAttempts != 4 || !j.ScheduledRunTime.IsZero() ||
		string(j.JobData) != "null" || j.State != StateInitial || j.Error != ErrorNone {
		t.Errorf("defaults not applied: %+v", j)
	}
	req, _ = DecodeRequest([]byte(`{"job_type":"t","job_key":"k","throttle_factor":4}`), 0)
	if _, err := NewJob(req, jt, now); err == nil || !strings.Contains(err.Error(), "throttle_factor") {
		t.Errorf("a factor above the queue limit was accepted: %v", err)
	}
	req, _ = DecodeRequest([]byte(`{"job_type":"t","job_key":"k","time_windows":[{"start":"05:00","end":"07:00","tz":"UTC"}]}`), 0)
	j, _ = NewJob(req, jt, now)
	if want := now.Add(5 * time.Hour); !j.ScheduledRunTime.Equal(want) {
		t.Errorf("scheduled at %v, want first window opening %v", j.ScheduledRunTime, want)
	}
}

func FuzzDecodeRequest(f *testing.F) {
	for _, s := range []string{`{"job_type":"t","job_key":"k"}`, `{"job_type":"t","job_key":"k","job_data":{"a":[1,{"b":null}]}}`,
		`[]`, `{"priority":1e99}`, `{"job_type":"t","job_key":"k","time_windows":[{"start":"23:00","end":"01:00","tz":"UTC"}]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		req, err := DecodeRequest(b, 1<<16)
		if err != nil {
			var ie *InputError
			if !errors.As(err, &ie) {
				t.Fatalf("error is not an InputError: %v", err)
			}
			return
		}
		if req.JobType == "" || req.JobKey == "" {
			t.Fatalf("accepted without type or key: %q", b)
		}
		if CheckJSON(req.JobData, 0) != nil && len(req.JobData) > 0 {
			t.Fatalf("accepted job_data PostgreSQL cannot store: %q", req.JobData)
		}
	})
}

// FuzzCheckJSON holds CheckJSON's one-pass check of well-formed input to
// the token walk it stands in for: the same verdict, code and detail.
func FuzzCheckJSON(f *testing.F) {
	deep := strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth)
	for _, s := range []string{
		`{}`, `[]`, `1`, `"x"`, `null`, ` {"a": [1, 2, {"b": "c"}]} `, `{"a\u0000": 1}`, `{"a": "\u0000"}`,
		`["\\u0000"]`, `["\\\u0000"]`, `["\"\u0000"]`, `"\u00001"`, `["\u0001", "\u1000", "\u000A"]`,
		deep, "[" + deep + "]", `{"a":` + deep + `}`, `[` + strings.Repeat(`{"k":[`, 40) + `"\u0000"`,
		"[" + deep + `, "\u0000"]`, `["\u0000", ` + "[" + deep + "]]", `{} {}`, ``, ` `, `{`, `[1,]`, `"a\u000"`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		fast, slow := CheckJSON(b, 0), error(nil)
		if utf8.Valid(b) {
			slow = checkTokens(b)
		} else if fast == nil {
			t.Fatalf("CheckJSON took invalid UTF-8 %q", b)
		}
		if utf8.Valid(b) && fmt.Sprint(fast) != fmt.Sprint(slow) {
			t.Fatalf("CheckJSON(%q) = %v; the token walk says %v", b, fast, slow)
		}
	})
}

func BenchmarkCheckJSON(b *testing.B) {
	v := []byte(`{"job_type":"bench.noop","job_key":"k12345","job_data":{"t":1795625315529804960,"r":"a","list":[1,2,3],"s":"caf\u00e9"}}`)
	for b.Loop() {
		if err := CheckJSON(v, 0); err != nil {
			b.Fatal(err)
		}
	}
}

// FuzzDecodePlain holds the one-pass decoding of plain requests to the
// general way (checkFields, then encoding/json) on everything it takes.
func FuzzDecodePlain(f *testing.F) {
	for _, s := range []string{
		`{"job_type":"t","job_key":"k"}`, ` { "job_type" : "t" , "job_key" : "k" , "job_data" : {"a": [1, "]", {"}": 2}]} } `,
		`{"job_type":"t","job_key":"k","job_data":null}`, `{"job_type":"t","job_key":"k","job_data":"x\"}"}`,
		`{"job_type":"t","job_key":"k","job_data":12.5e3}`, `{"job_type":"t","job_key":"k","job_data":true }`,
		`{"job_type":"t","job_type":"u","job_key":"k","job_data":1,"job_data":[]}`, `{"job_type":"t\u0041","job_key":"k"}`,
		`{"job_typ\u0065":"t","job_key":"k"}`, `{"job_type":5,"job_key":"k"}`, `{"JOB_TYPE":"t","job_key":"k"}`,
		`{"job_type":"t","job_key":"k","priority":3}`, `{}`, `{"job_data":{}}`, `{"job_key":"", "job_data":[[],[{}]]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if CheckJSON(b, 0) != nil {
			return
		}
		if t := bytes.TrimLeft(b, " \t\r\n"); len(t) == 0 || t[0] != '{' {
			return
		}
		fast, ok := decodePlain(b)
		if !ok {
			return
		}
		var slow Request
		err := checkFields(b, requestFields)
		if err == nil {
			err = json.Unmarshal(b, &slow)
		}
		if err != nil || !reflect.DeepEqual(fast, slow) {
			t.Fatalf("%q: one pass %+v (%s), encoding/json %+v (%s), %v", b, fast, fast.JobData, slow, slow.JobData, err)
		}
	})
}

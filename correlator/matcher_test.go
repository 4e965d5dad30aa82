package correlator

import (
	"errors"
	"fmt"
	"reflect"
	"testing"
)

func TestMatcher(t *testing.T) {
	hdr := func(kv ...string) []Header {
		var hs []Header
		for i := 0; i < len(kv); i += 2 {
			hs = append(hs, Header{Key: kv[i], Value: []byte(kv[i+1])})
		}
		return hs
	}
	std := hdr(HeaderJobType, "t", HeaderJobKey, "k", HeaderAttempt, "2", HeaderJobID, "42")
	def := DefaultMatcher()
	custom := DefaultMatcher()
	custom.JobID = Field{}
	custom.JobType = Field{Value: ptr("invoice.ship")}
	custom.JobKey = Field{RecordKey: true}
	custom.Attempt = Field{JSON: "/meta/attempt"}
	custom.Status = Field{JSON: "/state"}
	custom.Success, custom.Failure = []string{"DONE"}, []string{"BROKEN"}
	custom.Result = Field{JSON: "/data"}
	tests := []struct {
		name    string
		m       Matcher
		rec     Record
		want    Reply
		errCode string
	}{
		{"defaults, success", def, Record{Value: []byte(`{"status":"ok","x":1}`), Headers: std},
			Reply{JobID: ptr[int64](42), JobType: "t", JobKey: "k", Attempt: ptr(2), Success: true, Retryable: true, Result: []byte(`{"status":"ok","x":1}`)}, ""},
		{"no status is success", def, Record{Value: []byte(`{"x":1}`), Headers: std},
			Reply{JobID: ptr[int64](42), JobType: "t", JobKey: "k", Attempt: ptr(2), Success: true, Retryable: true, Result: []byte(`{"x":1}`)}, ""},
		{"not JSON is success stored as a string", def, Record{Value: []byte(`done!`), Headers: std},
			Reply{JobID: ptr[int64](42), JobType: "t", JobKey: "k", Attempt: ptr(2), Success: true, Retryable: true, Result: []byte(`"done!"`)}, ""},
		{"failure not retryable", def, Record{Value: []byte(`{"status":"error","error":"nope","retryable":false}`), Headers: std},
			Reply{JobID: ptr[int64](42), JobType: "t", JobKey: "k", Attempt: ptr(2), Success: false, Retryable: false, Error: "nope",
				Result: []byte(`{"status":"error","error":"nope","retryable":false}`)}, ""},
		{"custom fields", custom, Record{Key: []byte("shp_1"), Value: []byte(`{"state":"BROKEN","meta":{"attempt":3},"data":{"a":1}}`)},
			Reply{JobType: "invoice.ship", JobKey: "shp_1", Attempt: ptr(3), Success: false, Retryable: true, Result: []byte(`{"a":1}`)}, ""},
		{"unknown status", def, Record{Value: []byte(`{"status":"maybe"}`), Headers: std}, Reply{}, CodeInvalidField},
		{"unreadable attempt", def, Record{Value: []byte(`{}`), Headers: hdr(HeaderJobType, "t", HeaderJobKey, "k", HeaderAttempt, "two")}, Reply{}, CodeInvalidField},
		{"unreadable job id", def, Record{Value: []byte(`{}`), Headers: hdr(HeaderJobID, "x")}, Reply{}, CodeInvalidField},
		{"no type or key", def, Record{Value: []byte(`{}`)}, Reply{}, CodeMissingField},
		{"NUL in JSON", def, Record{Value: []byte(`{"a":"\u0000"}`), Headers: std}, Reply{}, CodeNullChar},
		{"invalid UTF-8", def, Record{Value: []byte("\xff"), Headers: std}, Reply{}, CodeInvalidUTF8},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.m.Match(&tt.rec)
			if tt.errCode != "" {
				var ie *InputError
				if !errors.As(err, &ie) || ie.Code != tt.errCode {
					t.Fatalf("got %v, want code %s", err, tt.errCode)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !equalReply(got, &tt.want) {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func equalReply(a, b *Reply) bool {
	eqI := func(x, y *int) bool { return (x == nil) == (y == nil) && (x == nil || *x == *y) }
	eqI64 := func(x, y *int64) bool { return (x == nil) == (y == nil) && (x == nil || *x == *y) }
	return eqI64(a.JobID, b.JobID) && a.JobType == b.JobType && a.JobKey == b.JobKey && eqI(a.Attempt, b.Attempt) &&
		a.Success == b.Success && a.Retryable == b.Retryable && a.Error == b.Error && string(a.Result) == string(b.Result)
}

func FuzzMatch(f *testing.F) {
	f.Add([]byte(`{"status":"ok"}`), []byte("k"), "2", "42")
	f.Add([]byte(`not json`), []byte(nil), "x", "")
	m := DefaultMatcher()
	f.Fuzz(func(t *testing.T, value, key []byte, attempt, id string) {
		rec := &Record{Key: key, Value: value, Headers: []Header{{HeaderJobType, []byte("t")}, {HeaderJobKey, key},
			{HeaderAttempt, []byte(attempt)}, {HeaderJobID, []byte(id)}}}
		r, err := m.Match(rec)
		if err != nil {
			var ie *InputError
			if !errors.As(err, &ie) {
				t.Fatalf("error is not an InputError: %v", err)
			}
			return
		}
		if err := CheckJSON(r.Result, 0); err != nil {
			t.Fatalf("result PostgreSQL cannot store: %q: %v", r.Result, err)
		}
		if r.Attempt != nil && *r.Attempt < 1 {
			t.Fatalf("attempt %d accepted", *r.Attempt)
		}
	})
}

// FuzzMatchMembers holds the one-pass reading of top-level members to the
// decoding of the whole value: with every field read from JSON, by
// one-token pointers, escaped ones and deeper ones, both give the same
// reply or the same error.
func FuzzMatchMembers(f *testing.F) {
	for _, s := range []string{
		`{"status":"ok","id":"7","type":"t","key":"k","attempt":2,"result":{"b":1,"a":[1,"<&>"]}}`,
		`{"status":"failed","retryable":false,"error":"boom \u00e9","retry_after":"3","id":7,"type":"t","key":"k"}`,
		`{"status":"progress","result":"<b>","type":"t","key":"k\"q","a/b":1,"m~n":2,"x":{"y":"ok"}}`,
		`{"status":"ok","status":"failed","type":"t","key":"k","result":null,"retryable":null,"error":12.50}`,
		`{"st\u0061tus":"ok","type":"t","key":"k"}`, `[1]`, `"x"`, `{} {}`, `{"type":"t","key":"k","error":true}`,
	} {
		f.Add([]byte(s))
	}
	m := DefaultMatcher()
	m.JobID, m.JobType, m.JobKey, m.Attempt = Field{JSON: "/id"}, Field{JSON: "/type"}, Field{JSON: "/key"}, Field{JSON: "/attempt"}
	deep := m
	deep.Error, deep.Result, deep.Status = Field{JSON: "/a~1b"}, Field{JSON: "/x/y"}, Field{JSON: "/m~0n"}
	each := m
	each.Result = Field{JSON: "/result"}
	f.Fuzz(func(t *testing.T, value []byte) {
		for _, m := range []Matcher{m, deep, each} {
			rec := &Record{Value: value}
			fast, ferr := m.match(rec, true)
			slow, serr := m.match(rec, false)
			if fmt.Sprint(ferr) != fmt.Sprint(serr) || !reflect.DeepEqual(fast, slow) {
				t.Fatalf("%q: one pass %+v, %v; decoded %+v, %v", value, fast, ferr, slow, serr)
			}
		}
	})
}

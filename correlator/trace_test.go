package correlator

import "testing"

func TestTraceContextOf(t *testing.T) {
	const valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	const future = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for _, c := range []struct {
		parent string
		ok     bool
	}{
		{valid, true},
		{future, true},
		{future + "-more", true}, // a future version: its first 55 bytes are kept
		{future + "-\x00", true},
		{future + "-\xff\xfe", true},
		{future + "-a\xc3(", true},
		{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more", false},
		{"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", false},
		{"00-00000000000000000000000000000000-00f067aa0ba902b7-01", false},
		{"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", false},
		{"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", false},
		{"00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01", false},
		{"garbage", false},
		{"", false},
	} {
		tc := TraceContextOf([]Header{{Key: "TraceParent", Value: []byte(c.parent)}, {Key: "tracestate", Value: []byte("k=v")}})
		if got := !tc.IsZero(); got != c.ok {
			t.Errorf("%q: valid=%v, want %v", c.parent, got, c.ok)
		}
		if c.ok && (tc.Parent != c.parent[:55] || tc.State != "k=v") {
			t.Errorf("%q: %+v", c.parent, tc)
		}
	}
	for _, state := range []string{"k=\x01", "k=\x00", "k=\xff", "k=\xc3(", "k=é"} {
		if tc := TraceContextOf([]Header{{Key: "traceparent", Value: []byte(valid)}, {Key: "tracestate", Value: []byte(state)}}); tc.State != "" || tc.Parent != valid {
			t.Errorf("tracestate %q: got %+v, want the traceparent alone", state, tc)
		}
	}
}

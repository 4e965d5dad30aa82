package correlator

import (
	"encoding/json"
	"errors"
	"testing"
	"time"
)

func TestNewSharesCaps(t *testing.T) {
	tests := []struct {
		name    string
		weights map[string]int
		limit   int
		caps    map[string]int
		other   int
	}{
		{"spec example", map[string]int{"east": 40, "north": 30, "west": 30}, 100, map[string]int{"east": 40, "north": 30, "west": 30}, 0},
		{"floor", map[string]int{"a": 1, "b": 1, "c": 1}, 10, map[string]int{"a": 3, "b": 3, "c": 3}, 0},
		{"at least 1", map[string]int{"big": 1000, "tiny": 1}, 10, map[string]int{"big": 9, "tiny": 1}, 0},
		{"pooled", map[string]int{"east": 2, "*": 1}, 9, map[string]int{"east": 6}, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := NewShares("/region", tt.weights, tt.limit)
			if err != nil {
				t.Fatal(err)
			}
			if len(s.Caps) != len(tt.caps) || s.OtherCap != tt.other {
				t.Fatalf("caps %v other %d, want %v other %d", s.Caps, s.OtherCap, tt.caps, tt.other)
			}
			for k, v := range tt.caps {
				if s.Caps[k] != v {
					t.Errorf("cap of %s = %d, want %d", k, s.Caps[k], v)
				}
			}
		})
	}
	for _, bad := range []struct {
		ptr     string
		weights map[string]int
		limit   int
	}{{"region", map[string]int{"a": 1}, 5}, {"/r", map[string]int{"a": 0}, 5}, {"/r", nil, 5}, {"/r", map[string]int{"a": 1}, 0}} {
		if _, err := NewShares(bad.ptr, bad.weights, bad.limit); err == nil {
			t.Errorf("NewShares(%q, %v, %d) accepted", bad.ptr, bad.weights, bad.limit)
		}
	}
}

func TestSharesPartition(t *testing.T) {
	s, err := NewShares("/a~1b/0", map[string]int{"x": 1, "7": 1, "true": 1, "*": 1}, 8)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Path) != 2 || s.Path[0] != "a/b" || s.Path[1] != "0" {
		t.Fatalf("path %q", s.Path)
	}
	for data, want := range map[string]string{
		`{"a/b": ["x"]}`:  "x",
		`{"a/b": [7]}`:    "7",
		`{"a/b": [true]}`: "true",
		`{"a/b": ["y"]}`:  OtherPartition,
		`{"a/b": [null]}`: OtherPartition,
		`{"a/b": []}`:     OtherPartition,
		`{}`:              OtherPartition,
		`not json`:        OtherPartition,
	} {
		if got, _ := s.Partition(json.RawMessage(data)); got != want {
			t.Errorf("%s: partition %q, want %q", data, got, want)
		}
	}
}

// A job heavier than its queue limit or its partition's share could never
// run: refused at intake. Critical types are bound by neither.
func TestNewJobRefusesWhatCouldNeverRun(t *testing.T) {
	shares, _ := NewShares("/region", map[string]int{"east": 1, "west": 3}, 8) // east 2, west 6
	jt := &JobType{Name: "t", Queue: "q", Timeout: time.Hour, Priority: 100, ThrottleFactor: 1, QueueLimit: 8, Shares: shares}
	three := 3
	nine := 9
	cases := []struct {
		data   string
		factor *int
		crit   bool
		ok     bool
	}{
		{`{"region":"west"}`, &three, false, true},
		{`{"region":"east"}`, &three, false, false},
		{`{"region":"north"}`, &three, false, true}, // not listed, no "*": only the limit bounds it
		{`{"region":"west"}`, &nine, false, false},
		{`{"region":"east"}`, &nine, true, true},
	}
	for _, c := range cases {
		jt.Critical = c.crit
		_, err := NewJob(&Request{JobType: "t", JobKey: "k", JobData: json.RawMessage(c.data), ThrottleFactor: c.factor}, jt, time.Now())
		var ie *InputError
		if c.ok != (err == nil) || (err != nil && !errors.As(err, &ie)) {
			t.Errorf("%s factor %d critical %v: err %v", c.data, *c.factor, c.crit, err)
		}
	}
}

// A number is put in the partition PostgreSQL's #>> names (the claim reads
// partitions there): its numeric text, never the number as written.
func TestSharesPartitionReadsNumbersAsPostgreSQL(t *testing.T) {
	s, err := NewShares("/tenant", map[string]int{"100": 1, "1.50": 1, "0": 1, "0.01": 1, "*": 3}, 8)
	if err != nil {
		t.Fatal(err)
	}
	for in, want := range map[string]string{
		`1e2`: "100", `100`: "100", `1E+2`: "100", `10.0e1`: "100", `1.50`: "1.50", `15.0e-1`: "1.50",
		`-0`: "0", `0`: "0", `1e-2`: "0.01", `"100"`: "100", `1.5`: "*", `null`: "*",
	} {
		if got, _ := s.Partition(json.RawMessage(`{"tenant": ` + in + `}`)); got != want {
			t.Errorf("tenant %s: partition %q, want %q", in, got, want)
		}
	}
}

// numericText writes what PostgreSQL writes (each pair checked against
// PostgreSQL 15's jsonb #>>).
func TestNumericTextIsPostgreSQLs(t *testing.T) {
	for in, want := range map[string]string{
		"1e2": "100", "1E+2": "100", "10.0e1": "100", "1.50": "1.50", "15.0e-1": "1.50", "-0": "0", "-0.0": "0.0",
		"1e-2": "0.01", "2.5e0": "2.5", "1e20": "100000000000000000000", "-1.23e-5": "-0.0000123",
	} {
		if got := numericText(json.Number(in)); got != want {
			t.Errorf("numericText(%s) = %q, want %q", in, got, want)
		}
	}
}

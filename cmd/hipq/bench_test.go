package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// hipq bench runs end to end by both ways in (a small n: this checks it
// works, it measures nothing).
func TestBenchRuns(t *testing.T) {
	t.Parallel()
	for _, intake := range []string{"kafka", "outbox"} {
		var out strings.Builder
		if err := cmdBench([]string{"-n", "300", "--json", "--intake", intake, "--outbox-batch", "7"}, &out); err != nil {
			t.Fatalf("%s: %v\n%s", intake, err, out.String())
		}
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		var res benchResult
		if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil || res.Jobs != 300 || res.JobsPerSec <= 0 {
			t.Fatalf("%s: %+v %v\n%s", intake, res, err, out.String())
		}
	}
	var out strings.Builder
	if err := cmdBench([]string{"--intake", "carrier-pigeon"}, &out); err == nil || !strings.Contains(err.Error(), "--intake") {
		t.Fatalf("a bad --intake: %v", err)
	}
}

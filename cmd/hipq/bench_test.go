package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/hipq/hipq/internal/localcitus"
	"github.com/hipq/hipq/internal/memlimit"
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
		if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil || res.Jobs != 300 || res.JobsPerSec <= 0 || res.MemoryLimitBytes <= 0 {
			t.Fatalf("%s: %+v %v\n%s", intake, res, err, out.String())
		}
	}
	var out strings.Builder
	if err := cmdBench([]string{"--intake", "carrier-pigeon"}, &out); err == nil || !strings.Contains(err.Error(), "--intake") {
		t.Fatalf("a bad --intake: %v", err)
	}
	for _, bad := range [][]string{{"--instances", "0"}, {"--rate", "-1"}, {"--expired"}, {"--backlog", "-5"},
		{"--memory-limit", "lots"}, {"--memory-limit", "16MiB"}} {
		if err := cmdBench(bad, &out); err == nil {
			t.Errorf("%v: no error", bad)
		} else if bad[0] == "--memory-limit" && !strings.HasPrefix(err.Error(), "--memory-limit: ") {
			t.Errorf("%v: %v, want an error naming --memory-limit", bad, err)
		}
	}
}

// Every flag of the bench, together, on a small run: two instances, an
// open-loop rate, a backlog, expired final rows pruned during the run,
// and a database profile (or the reason there is none).
func TestBenchFlags(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	err := cmdBench([]string{"--json", "--instances", "2", "--rate", "200", "--duration", "2s", "--backlog", "500",
		"--final-rows", "3000", "--expired", "--db-profile", "--memory-limit", "96MiB"}, &out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	var res benchResult
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if res.Jobs != 400 || res.Instances != 2 || res.Rate != 200 || res.Backlog != 500 || res.FinalRows != 3000 ||
		res.MaxMs < res.P99ms || res.PeakRSSBytes <= 0 || res.MemoryLimitBytes != 96<<20 || res.PrunedPerSec <= 0 ||
		res.SlowestSecond < 1 || res.SlowestSecond > 3 || res.SlowestP99ms <= 0 || res.SlowestP99ms > res.MaxMs {
		t.Fatalf("%+v\n%s", res, out.String())
	}
	for _, want := range []string{"2 hipq instance(s)", "retention prune:", "db profile", "slowest second: the ", "against a memory limit of 96MiB"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the output does not say %q:\n%s", want, out.String())
		}
	}
}

// hipq bench --events publishes each job's outcome event and ends once
// every one reached Kafka (a small n: this checks it works).
func TestBenchEvents(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	if err := cmdBench([]string{"-n", "200", "--json", "--events"}, &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	var res benchResult
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil || res.Jobs != 200 || !res.Events || res.JobsPerSec <= 0 {
		t.Fatalf("%+v %v\n%s", res, err, out.String())
	}
	if !strings.Contains(out.String(), "outcome event on Kafka") {
		t.Errorf("the output does not say the events are part of the run:\n%s", out.String())
	}
}

// BenchmarkBurstMemory runs a burst of 100,000 jobs through hipq bench at
// the default memory limit and reports the instance's peak resident set;
// it fails when that passes the limit by more than 10%. A benchmark, not a
// test: a run takes the machine for seconds, and what it measures needs
// a machine of its own.
func BenchmarkBurstMemory(b *testing.B) {
	var peak, limit int64
	for b.Loop() {
		var out strings.Builder
		if err := cmdBench([]string{"-n", "100000", "--json", "--memory-limit", memlimit.Format(memlimit.Default)}, &out); err != nil {
			b.Fatalf("%v\n%s", err, out.String())
		}
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		var res benchResult
		if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil {
			b.Fatalf("%v\n%s", err, out.String())
		}
		peak, limit = max(peak, res.PeakRSSBytes), res.MemoryLimitBytes
		if res.PeakRSSBytes > limit+limit/10 {
			b.Errorf("peak RSS %s passes the memory limit of %s by more than 10%%", memlimit.Format(res.PeakRSSBytes), memlimit.Format(limit))
		}
	}
	b.ReportMetric(float64(peak), "peak_rss_bytes")
	b.ReportMetric(float64(limit), "memory_limit_bytes")
}

// hipq bench --citus-workers runs end to end on a throwaway Citus cluster
// of its own, and --db-profile gives each node's statement time: the
// coordinator's and each worker's (a small n: this checks it works).
func TestBenchCitus(t *testing.T) {
	t.Parallel()
	if ok, why := localcitus.Installed(); !ok {
		t.Skip(why + ": hipq bench --citus-workers needs Citus")
	}
	var out strings.Builder
	if err := cmdBench([]string{"-n", "300", "--citus-workers", "2", "--db-profile", "--json"}, &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	var res benchResult
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil || res.Jobs != 300 || res.JobsPerSec <= 0 || res.CitusWorkers != 2 {
		t.Fatalf("%+v %v\n%s", res, err, out.String())
	}
	if !strings.Contains(out.String(), "Citus: a coordinator and 2 workers") {
		t.Errorf("the output does not name the cluster:\n%s", out.String())
	}
	var names []string
	for _, n := range res.DBProfileNodes {
		names = append(names, n.Node)
		if n.StatementUsPerJob <= 0 || len(n.Families) == 0 {
			t.Errorf("%s: no statement time (%v µs per job, %d families)\n%s", n.Node, n.StatementUsPerJob, len(n.Families), out.String())
		}
	}
	if strings.Join(names, ", ") != "coordinator, worker 1, worker 2" {
		t.Fatalf("profiled nodes %q, want the coordinator and 2 workers\n%s", names, out.String())
	}
	if res.StatementUsPerJob != res.DBProfileNodes[0].StatementUsPerJob {
		t.Errorf("statement_us_per_job %v is not the coordinator's %v", res.StatementUsPerJob, res.DBProfileNodes[0].StatementUsPerJob)
	}
}

// --citus-on-worker: the instances run on the worker that holds the
// bench's queue, every job still ends, and the queue's worker does the
// jobs' statements.
func TestBenchCitusOnWorker(t *testing.T) {
	t.Parallel()
	if ok, why := localcitus.Installed(); !ok {
		t.Skip(why + ": hipq bench --citus-workers needs Citus")
	}
	var out strings.Builder
	if err := cmdBench([]string{"-n", "300", "--citus-workers", "2", "--citus-on-worker", "--db-profile", "--json"}, &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	var res benchResult
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil || res.Jobs != 300 || res.JobsPerSec <= 0 {
		t.Fatalf("%+v %v\n%s", res, err, out.String())
	}
	if !strings.Contains(out.String(), "hipq instances connected to the worker that holds the queue") {
		t.Errorf("the output does not say where the instances run:\n%s", out.String())
	}
}

// --citus-workers starts a cluster of its own: with $HIPQ_DATABASE_URL,
// which names the database to use, it is refused before anything starts,
// saying both; a count out of range is refused naming the flag.
func TestBenchCitusRefusals(t *testing.T) {
	t.Setenv("HIPQ_DATABASE_URL", "postgres://nowhere.invalid/hipq")
	var out strings.Builder
	err := cmdBench([]string{"-n", "10", "--citus-workers", "2"}, &out)
	if err == nil || !strings.Contains(err.Error(), "--citus-workers starts a Citus cluster of its own") || !strings.Contains(err.Error(), "$HIPQ_DATABASE_URL") {
		t.Fatalf("--citus-workers with $HIPQ_DATABASE_URL: %v", err)
	}
	if err := cmdBench([]string{"--citus-on-worker"}, &out); err == nil || !strings.Contains(err.Error(), "--citus-on-worker needs --citus-workers") {
		t.Errorf("--citus-on-worker alone: %v, want an error naming both flags", err)
	}
	for _, bad := range []string{"-1", "17"} {
		if err := cmdBench([]string{"--citus-workers", bad}, &out); err == nil || !strings.HasPrefix(err.Error(), "--citus-workers: ") {
			t.Errorf("--citus-workers %s: %v, want an error naming --citus-workers", bad, err)
		}
	}
}

package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/testutil"
)

// runResponder starts a responder process from examples/ against e's
// cluster, answering requests on replies, until the test ends.
func runResponder(t *testing.T, e *env, dir string, name string, args ...string) {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "BROKERS="+strings.Join(e.kafka.Brokers, ","), "REQUESTS="+e.kafka.Topic("requests"),
		"REPLIES="+e.kafka.Topic("replies"), fmt.Sprintf("GROUP=responder-%d", time.Now().UnixNano()))
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("%s output:\n%s", name, out.String())
		}
	})
}

// foreignRoundTrip runs jobs through hipq with the default config, answered
// by a responder in another language.
func foreignRoundTrip(t *testing.T, start func(e *env)) {
	e := newEnv(t, e2eTopics...)
	a := e.start(e.config(e2eConfig), "intake", "dispatcher", "responses")
	start(e)
	var jobs []string
	for i := range 5 {
		jobs = append(jobs, jobReq(fmt.Sprintf("foreign-%d", i)))
	}
	e.produce("jobs", jobs...)
	testutil.Eventually(t, 90*time.Second, func() (bool, string) {
		n := e.countJobs(a, "state = 'final' AND outcome = 'succeeded' AND result ? 'echo'")
		return n == 5, fmt.Sprintf("%d of 5 succeeded", n)
	}, "jobs answered by the responder")
}

// nodeExample copies examples/example (its main file and package.json)
// into a directory of the test's and installs its dependencies there with
// npm; it skips t, naming what (the Node responder, the Node caller), where
// node or npm is missing or npm cannot install.
func nodeExample(t *testing.T, example, main, what string) string {
	t.Helper()
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed: the Node %s (examples/%s) is not tried", tool, what, example)
		}
	}
	dir := t.TempDir()
	for _, f := range []string{main, "package.json"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "examples", example, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	install := exec.CommandContext(ctx, "npm", "install", "--no-audit", "--no-fund", "--loglevel=error")
	install.Dir = dir
	if out, err := install.CombinedOutput(); err != nil {
		t.Skipf("npm could not install kafkajs 2.2.4 (no registry here?), so the Node %s is not tried: %v\n%s", what, err, out)
	}
	return dir
}

// Issue 16: a stock kafkajs 2.2.4 consumer with no extra codec reads
// hipq's requests (written uncompressed by default), and its replies,
// which copy the hipq-* headers, finalize the jobs.
func TestNodeResponder(t *testing.T) {
	t.Parallel()
	dir := nodeExample(t, "responder-node", "responder.js", "responder")
	foreignRoundTrip(t, func(e *env) { runResponder(t, e, dir, "node", "responder.js") })
}

// Issue 16: the same with a Python responder on confluent-kafka.
func TestPythonResponder(t *testing.T) {
	t.Parallel()
	// The python3 on PATH, or the system's (Debian's python3-confluent-kafka).
	python := ""
	for _, p := range []string{"python3", "/usr/bin/python3"} {
		if exec.Command(p, "-c", "import confluent_kafka").Run() == nil {
			python = p
			break
		}
	}
	if python == "" {
		t.Skip("no python3 with confluent-kafka (pip install confluent-kafka, or apt-get install python3-confluent-kafka), so the Python responder is not tried")
	}
	dir, err := filepath.Abs(filepath.Join("..", "..", "examples", "responder-python"))
	if err != nil {
		t.Fatal(err)
	}
	foreignRoundTrip(t, func(e *env) { runResponder(t, e, dir, python, "responder.py") })
}

// Issue 33: request/reply over Kafka from Node: examples/caller-node
// produces jobs naming its reply topic and a correlation id of its own,
// and reads each job's outcome event back with stock kafkajs 2.2.4 and no
// extra codec.
func TestNodeCaller(t *testing.T) {
	t.Parallel()
	dir := nodeExample(t, "caller-node", "caller.js", "caller")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	e := newEnv(t, eventsTopics...)
	e.start(e.config(eventsConfig()))
	e.respond(ctx, "requests", "replies", func(string, int) (string, bool) { return "succeeded", true })
	caller := exec.CommandContext(ctx, "node", "caller.js")
	caller.Dir = dir
	caller.Env = append(os.Environ(), "BROKERS="+strings.Join(e.kafka.Brokers, ","), "INTAKE="+e.kafka.Topic("jobs"),
		"REPLY_TO="+e.kafka.Topic("callers.a"), "JOB_TYPE=e2e", "KEYS=node-1,node-2,node-3")
	out, err := caller.CombinedOutput()
	if err != nil {
		t.Fatalf("node caller.js: %v\n%s", err, out)
	}
	for _, k := range []string{"node-1", "node-2", "node-3"} {
		if !strings.Contains(string(out), `{"key":"`+k+`","outcome":"succeeded"`) {
			t.Errorf("no succeeded outcome of %s:\n%s", k, out)
		}
	}
}

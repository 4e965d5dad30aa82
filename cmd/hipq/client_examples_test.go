package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/testutil"
)

// Issue 12: the client module's examples (client, pgxoutbox, sqloutbox,
// kafkaintake) run, as `go test` runs them, against a live hipq: its API,
// its outbox and its Kafka intake on a throwaway PostgreSQL and embedded
// Kafka. Then every job they enqueued, by every path, is a job.
func TestClientExamples(t *testing.T) {
	t.Parallel()
	goBin, err := exec.LookPath("go") // go test puts its own GOROOT/bin first on PATH
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, "jobs", "requests", "quotes", "replies", "callers")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	apiAddr := l.Addr().String()
	l.Close()
	token := strings.Repeat("T", 32)
	cfg := e.config(fmt.Sprintf(`
name: examples
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"]}
intake: {topics: ["{{T:jobs}}"]}
responses: {topics: [{topic: "{{T:replies}}"}]}
dispatch: {interval: 100ms}
events: {allowed_reply_to: ["{{T:callers}}"]}
api: {listen: "%s", tokens: ["%s"], callback_secret: "%s"}
job_types:
  - name: invoice.quote
    transport: {kafka: {topic: "{{T:quotes}}"}}
    reply_topic: "{{T:replies}}"
    timeout: 1h
  - name: invoice.ship
    transport: {kafka: {topic: "{{T:requests}}"}}
    timeout: 1h
  - name: invoice.list
    transport: {kafka: {topic: "{{T:requests}}"}}
    timeout: 1h
`, apiAddr, token, strings.Repeat("S", 32)))
	a := e.start(cfg)
	rctx, stopResponder := context.WithCancel(context.Background())
	defer stopResponder()
	e.respond(rctx, "quotes", "replies", func(string, int) (string, bool) { return "succeeded", true })

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, goBin, "test", "-count=1", "-run", "^Example", "./...")
	cmd.Dir = filepath.Join("..", "..", "client")
	cmd.Env = append(os.Environ(),
		"HIPQ_EXAMPLE_API_URL=http://"+apiAddr, "HIPQ_EXAMPLE_API_TOKEN="+token,
		"HIPQ_EXAMPLE_DATABASE_URL="+e.dbURL, "HIPQ_EXAMPLE_BROKERS="+strings.Join(e.kafka.Brokers, ","),
		"HIPQ_EXAMPLE_INTAKE_TOPIC="+e.kafka.Topic("jobs"), "HIPQ_EXAMPLE_REPLY_TOPIC="+e.kafka.Topic("callers"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the client module's examples: %v\n%s", err, out)
	}
	for _, pkg := range []string{"client\t", "client/pgxoutbox", "client/sqloutbox", "client/kafkaintake"} {
		if !strings.Contains(string(out), "ok  \tgithub.com/hipq/hipq/"+pkg) || strings.Contains(string(out), "[no tests to run]") {
			t.Fatalf("examples of %s did not run:\n%s", pkg, out)
		}
	}
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(a, "job_key IN ('shp_enqueue', 'shp_wait', 'shp_pgx', 'shp_sql', 'shp_kafka', 'shp_list_1', 'shp_list_2', 'shp_list_3', 'quote_1')")
		return n == 9, fmt.Sprintf("%d of 9 jobs", n)
	}, "the examples' jobs")
}

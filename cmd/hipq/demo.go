package main

import (
	"context"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

const demoConfig = `
name: hipq-demo
database: {url: "${DB}", schema: SCHEMA}
kafka: {brokers: [BROKERS]}
intake: {topics: [hipq.jobs], dead_letter_topic: hipq.jobs.dlq}
responses:
  early_ttl: 1m
  dead_letter_topic: hipq.responses.dlq
  topics: [{topic: demo.responses}]
dispatch: {interval: 200ms, batch_size: 100, grace: 5s}
sweeper: {schedule: "@every 1s"}
metrics: {listen: "127.0.0.1:0"}
job_types:
  - name: demo.echo
    transport: {kafka: {topic: demo.requests}}
    reply_topic: demo.responses
    timeout: 3s
    retry: {max_attempts: 3, backoff: fixed, initial: 1s, jitter: 0}
`

// demoFate is what the demo's responder does with a job, by key.
func demoFate(key string, attempt int) (string, bool) {
	h := fnv.New32a()
	h.Write([]byte(key))
	switch v := h.Sum32() % 100; {
	case v < 8: // ignored once: times out, then succeeds on retry
		return "succeeded", attempt > 1
	case v < 18: // fails once, then succeeds on retry
		if attempt == 1 {
			return "failed", true
		}
	case v < 21: // always fails: retries run out
		return "failed", true
	}
	return "succeeded", true
}

func cmdDemo(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	n := fs.Int("n", 200, "jobs to run")
	if err := fs.Parse(args); err != nil {
		return &exitError{2, err}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 55*time.Second)
	defer cancel()
	fmt.Fprintln(stdout, "hipq demo: starting an embedded Kafka and PostgreSQL…")
	sb, err := newSandbox(ctx, false, 3, "hipq.jobs", "hipq.jobs.dlq", "demo.requests", "demo.responses", "hipq.responses.dlq")
	if err != nil {
		return err
	}
	defer sb.close()
	a, done, err := sb.newApp(ctx, demoConfig, "hipq_demo", "error")
	if err != nil {
		return err
	}
	defer done()
	fmt.Fprintf(stdout, "  Kafka at %s, %s\n", strings.Join(sb.brokers, ","), sb.dbDescription())
	fmt.Fprintln(stdout, "  responder: most jobs succeed, ~10% fail once, ~8% are ignored once (they time out after 3s), ~3% always fail")

	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	resp, err := newResponder(sb.brokers, "demo-responder", "demo.requests", "demo.responses", demoFate)
	if err != nil {
		return err
	}
	go resp.run(runCtx)
	runDone := make(chan error, 1)
	go func() { runDone <- a.run(runCtx) }()

	// Producers write job requests to the intake topic; two are malformed
	// on purpose and end as dead letters.
	prod, err := kgo.NewClient(kgo.SeedBrokers(sb.brokers...))
	if err != nil {
		return err
	}
	defer prod.Close()
	var recs []*kgo.Record
	for i := range *n {
		v := fmt.Sprintf(`{"job_type":"demo.echo","job_key":"order-%04d","job_data":{"order":%d}}`, i, i)
		recs = append(recs, &kgo.Record{Topic: "hipq.jobs", Key: []byte(fmt.Sprintf("order-%04d", i)), Value: []byte(v)})
	}
	recs = append(recs,
		&kgo.Record{Topic: "hipq.jobs", Value: []byte(`{"job_type":"demo.echo","job_kye":"typo"}`)},
		&kgo.Record{Topic: "hipq.jobs", Value: []byte(`not json`)})
	start := time.Now()
	if err := prod.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		return fmt.Errorf("produce demo jobs: %w", err)
	}
	fmt.Fprintf(stdout, "  produced %d job requests (+2 malformed) to hipq.jobs\n\n", *n)

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var counts map[correlator.State]int
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("demo did not finish in time: %v", counts)
		case err := <-runDone:
			return fmt.Errorf("hipq stopped: %v", err)
		case <-tick.C:
		}
		counts, err = a.st.JobCountByState(ctx)
		if err != nil {
			return err
		}
		el := time.Since(start).Seconds()
		fmt.Fprintf(stdout, "  %4.0fs  initial %4d  running %4d  retry %4d  final %4d   %6.0f jobs/s\n", el,
			counts[correlator.StateInitial], counts[correlator.StateRunning], counts[correlator.StateRetry],
			counts[correlator.StateFinal], float64(counts[correlator.StateFinal])/el)
		if counts[correlator.StateFinal] >= *n {
			break
		}
	}
	stopRun()
	_ = <-runDone // stopped: how its drain ended adds nothing to the summary
	return demoSummary(ctx, a.st, stdout, time.Since(start))
}

func demoSummary(ctx context.Context, st *store.Store, w io.Writer, took time.Duration) error {
	sum, err := st.RunSummary(ctx)
	if err != nil {
		return err
	}
	succeeded, failed, timedOut, retried, attempts, dead := sum.Succeeded, sum.Failed, sum.TimedOutAttempts, sum.Retried, sum.Attempts, sum.DeadLetters
	fmt.Fprintf(w, "\ndone in %.1fs\n", took.Seconds())
	fmt.Fprintf(w, "  succeeded %d, failed %d (retries exhausted)\n", succeeded, failed)
	fmt.Fprintf(w, "  %d jobs needed a retry; %d attempts timed out waiting for a reply; %d attempts in all\n", retried, timedOut, attempts)
	fmt.Fprintf(w, "  %d malformed requests kept as dead letters (hipq_dead_letter)\n", dead)
	return nil
}

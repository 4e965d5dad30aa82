package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/correlator"
)

const benchConfig = `
name: hipq-bench
database: {url: "${DB}", schema: SCHEMA, max_conns: 16}
kafka: {brokers: [BROKERS]}
intake: {topics: [hipq.jobs]}
responses: {topics: [{topic: bench.responses}]}
dispatch: {interval: 50ms, batch_size: 1000}
sweeper: {schedule: "@every 5s"}
log: {level: error}
job_types:
  - name: bench.noop
    transport: {kafka: {topic: bench.requests}}
    reply_topic: bench.responses
    timeout: 5m
`

type benchResult struct {
	Jobs         int     `json:"jobs"`
	Seconds      float64 `json:"seconds"`
	JobsPerSec   float64 `json:"jobs_per_sec"`
	P50ms        float64 `json:"p50_ms"`
	P99ms        float64 `json:"p99_ms"`
	PeakRSSBytes int64   `json:"peak_rss_bytes"`
}

func cmdBench(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	n := fs.Int("n", 20000, "jobs to run end to end")
	asJSON := fs.Bool("json", false, "print one JSON object on the last line")
	partitions := fs.Int("partitions", 6, "partitions of each topic")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of hipq to this file")
	throttle := fs.Int("throttle-limit", 0, "give the queue this throttle_limit (0 = unlimited), to measure what limits cost")
	shares := fs.Bool("shares", false, "with --throttle-limit: split the limit into three equal shares by job_data /r")
	rateLimit := fs.Int("rate-limit", 0, "give the queue a rate limit of this many requests per second (0 = none), to measure what rates cost")
	intake := fs.String("intake", "kafka", "how jobs come in: kafka (records to the intake topic) or outbox (rows of hipq_intake, 4 writers, --outbox-batch rows per transaction)")
	outboxBatch := fs.Int("outbox-batch", 100, "with --intake outbox: rows per application transaction")
	if err := fs.Parse(args); err != nil {
		return &exitError{2, err}
	}
	if *intake != "kafka" && *intake != "outbox" {
		return &exitError{2, fmt.Errorf("--intake: %q is not kafka or outbox", *intake)}
	}
	if *outboxBatch < 1 {
		return &exitError{2, fmt.Errorf("--outbox-batch: must be at least 1")}
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	sb, err := newSandbox(ctx, true, int32(*partitions), "hipq.jobs", "bench.requests", "bench.responses")
	if err != nil {
		return err
	}
	defer sb.close()
	conf := benchConfig
	if *shares && *throttle < 1 {
		return &exitError{2, fmt.Errorf("--shares needs --throttle-limit")}
	}
	if *rateLimit < 0 {
		return &exitError{2, fmt.Errorf("--rate-limit %d must not be negative", *rateLimit)}
	}
	if *throttle > 0 || *rateLimit > 0 {
		extra := ""
		if *shares {
			extra = ", shares: {by: {json: /r}, weights: {a: 1, b: 1, c: 1}}"
		}
		if *rateLimit > 0 {
			extra += fmt.Sprintf(", rates: [{limit: %d, period: 1s}]", *rateLimit)
		}
		conf += fmt.Sprintf("queues:\n  - {name: default, throttle_limit: %d%s}\n", *throttle, extra)
	}
	a, done, err := sb.newApp(ctx, conf, "hipq_bench", cmp.Or(os.Getenv("HIPQ_LOG_LEVEL"), "error"))
	if err != nil {
		return err
	}
	defer done()
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	resp, err := newResponder(sb.brokers, "bench-responder", "bench.requests", "bench.responses",
		func(string, int) (string, bool) { return "succeeded", true })
	if err != nil {
		return err
	}
	go resp.run(runCtx)
	runDone := make(chan error, 1)
	go func() { runDone <- a.run(runCtx) }()

	prod, err := kgo.NewClient(kgo.SeedBrokers(sb.brokers...), kgo.ProducerLinger(5*time.Millisecond))
	if err != nil {
		return err
	}
	defer prod.Close()
	limits := "no throttle"
	if *throttle > 0 {
		limits = fmt.Sprintf("throttle_limit %d", *throttle)
		if *shares {
			limits += " in three shares"
		}
	}
	if *rateLimit > 0 {
		limits = strings.TrimPrefix(limits+fmt.Sprintf(", rate limit %d/s", *rateLimit), "no throttle, ")
	}
	from := "Kafka intake"
	if *intake == "outbox" {
		from = fmt.Sprintf("outbox (transactions of %d rows)", *outboxBatch)
	}
	fmt.Fprintf(stdout, "hipq bench: %d jobs, %s → dispatch → responder → match → final, embedded Kafka (%d partitions), %s, %s\n",
		*n, from, *partitions, sb.dbDescription(), limits)
	start := time.Now()
	value := func(i int) string {
		return fmt.Sprintf(`{"job_type":"bench.noop","job_key":"k%d","job_data":{"t":%d,"r":"%c"}}`, i, time.Now().UnixNano(), 'a'+i%3)
	}
	writeErr := make(chan error, 4)
	if *intake == "kafka" {
		go func() {
			for i := range *n {
				prod.Produce(ctx, &kgo.Record{Topic: "hipq.jobs", Key: []byte("k" + strconv.Itoa(i)), Value: []byte(value(i))}, nil)
			}
			prod.Flush(ctx)
		}()
	} else {
		// Applications: 4 writers, each committing transactions of
		// outbox-batch rows.
		const writers = 4
		for w := range writers {
			go func() {
				for lo := w * *outboxBatch; lo < *n; lo += writers * *outboxBatch {
					vals := make([]string, 0, *outboxBatch)
					for i := lo; i < min(lo+*outboxBatch, *n); i++ {
						vals = append(vals, value(i))
					}
					if err := a.st.OutboxWrite(ctx, vals); err != nil {
						writeErr <- err
						return
					}
				}
			}()
		}
	}
	var final int
	for final < *n {
		select {
		case <-ctx.Done():
			return fmt.Errorf("bench did not finish: %d of %d final", final, *n)
		case err := <-runDone:
			return fmt.Errorf("hipq stopped: %v", err)
		case err := <-writeErr:
			return err
		case <-time.After(100 * time.Millisecond):
		}
		counts, err := a.st.JobCountByState(ctx)
		if err != nil {
			return err
		}
		final = counts[correlator.StateFinal]
	}
	lat, err := a.st.BenchLatencies(ctx)
	if err != nil {
		return err
	}
	res := benchResult{Jobs: *n, P50ms: lat.P50, P99ms: lat.P99}
	last, stages := lat.Last, [3][2]float64{lat.Intake, lat.Claim, lat.Reply}
	stopRun()
	<-runDone
	res.Seconds = last.Sub(start).Seconds()
	res.JobsPerSec = float64(*n) / res.Seconds
	res.PeakRSSBytes = peakRSS()
	fmt.Fprintf(stdout, "  %d jobs in %.2fs: %.0f jobs/s; round trip p50 %.1f ms, p99 %.1f ms; peak RSS %.0f MiB (hipq and embedded Kafka; PostgreSQL apart)\n",
		res.Jobs, res.Seconds, res.JobsPerSec, res.P50ms, res.P99ms, float64(res.PeakRSSBytes)/(1<<20))
	fmt.Fprintf(stdout, "  where jobs waited, p50/p99 ms: produce→stored %.0f/%.0f, stored→claimed %.0f/%.0f, claimed→final %.0f/%.0f\n",
		stages[0][0], stages[0][1], stages[1][0], stages[1][1], stages[2][0], stages[2][1])
	if *asJSON {
		b, _ := json.Marshal(res)
		fmt.Fprintln(stdout, string(b))
	}
	return nil
}

// peakRSS is this process's high-water resident set (VmHWM), in bytes.
func peakRSS() int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return 0
}

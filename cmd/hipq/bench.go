package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/internal/memlimit"
	"github.com/hipq/hipq/store"
)

const benchConfig = `
name: hipq-bench
database: {url: "${DB}", schema: SCHEMA, max_conns: 16}
kafka: {brokers: [BROKERS]}
intake: {topics: [hipq.jobs]}
responses: {topics: [{topic: bench.responses}]}
dispatch: {interval: 50ms, batch_size: 1000}
sweeper: {schedule: "@every 5s"}
metrics: {listen: "127.0.0.1:0"}
log: {level: error}
job_types:
  - name: bench.noop
    transport: {kafka: {topic: bench.requests}}
    reply_topic: bench.responses
    timeout: 5m
`

type benchResult struct {
	Jobs       int     `json:"jobs"`
	Seconds    float64 `json:"seconds"`
	JobsPerSec float64 `json:"jobs_per_sec"`
	P50ms      float64 `json:"p50_ms"`
	P99ms      float64 `json:"p99_ms"`
	MaxMs      float64 `json:"max_ms"`
	// The second of the run (1 = the first, counted from the first job
	// produced) whose jobs had the highest p99, and that p99: where the
	// tail came from (a start, a checkpoint), not only how long it was.
	SlowestSecond int     `json:"slowest_second"`
	SlowestP99ms  float64 `json:"slowest_second_p99_ms"`
	PeakRSSBytes  int64   `json:"peak_rss_bytes"` // the largest of the instances'
	// MemoryLimitBytes is the instances' memory limit, as they report it
	// (hipq_memory_limit_bytes; the largest of them).
	MemoryLimitBytes int64   `json:"memory_limit_bytes"`
	Instances        int     `json:"instances"`
	Rate             float64 `json:"rate,omitempty"` // offered load, jobs/s (open loop)
	Backlog          int     `json:"backlog,omitempty"`
	FinalRows        int     `json:"final_rows,omitempty"`
	PrunedPerSec     float64 `json:"pruned_per_sec,omitempty"`
	// StatementUsPerJob is PostgreSQL's statement time per job (with
	// --db-profile): on Citus, the coordinator's.
	StatementUsPerJob float64 `json:"statement_us_per_job,omitempty"`
	// CitusWorkers is the number of workers of the bench's own Citus
	// cluster (--citus-workers).
	CitusWorkers int `json:"citus_workers,omitempty"`
	// DBProfileNodes is the statement time of each node of the Citus
	// cluster, the coordinator first (--db-profile with --citus-workers).
	DBProfileNodes []nodeProfile `json:"db_profile_nodes,omitempty"`
	// Events: each job's outcome event was written and relayed (--events);
	// the run ends once every one was acknowledged by the broker.
	Events bool `json:"events,omitempty"`
	// EventsTailMs: with Events, how long after the last job ended (its
	// update_time) the last event was produced (its record's timestamp).
	EventsTailMs float64 `json:"events_tail_ms,omitempty"`
}

// nodeProfile is where one PostgreSQL server's statement time went.
type nodeProfile struct {
	Node              string          `json:"node"`
	StatementUsPerJob float64         `json:"statement_us_per_job"`
	Families          []familyProfile `json:"families"`
}

// familyProfile is one family of statements of a node's profile.
type familyProfile struct {
	Family   string  `json:"family"`
	Calls    int64   `json:"calls"`
	Rows     int64   `json:"rows"`
	Ms       float64 `json:"ms"`
	UsPerJob float64 `json:"us_per_job"`
}

// benchOpts are the bench's flags.
type benchOpts struct {
	n, partitions, instances, backlog, finalRows int
	rate                                         float64
	duration                                     time.Duration
	expired, dbProfile, asJSON                   bool
	throttle, rateLimit                          int
	citusWorkers                                 int
	citusOnWorker                                bool
	shares, events                               bool
	intake                                       string
	outboxBatch                                  int
	cpuProfile, memProfile                       string
	memoryLimit                                  int64 // 0: the instances resolve their own
}

func parseBench(args []string) (*benchOpts, error) {
	o := &benchOpts{}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.IntVar(&o.n, "n", 20000, "jobs to run end to end, produced at once (a burst); see --rate")
	fs.BoolVar(&o.asJSON, "json", false, "print one JSON object on the last line")
	fs.IntVar(&o.partitions, "partitions", 6, "partitions of each topic")
	fs.IntVar(&o.instances, "instances", 1, "hipq processes sharing the database and the consumer groups")
	fs.Float64Var(&o.rate, "rate", 0, "open loop: produce this many jobs per second for --duration (instead of -n at once) and report round trips")
	fs.DurationVar(&o.duration, "duration", 10*time.Second, "with --rate: how long to produce")
	fs.IntVar(&o.backlog, "backlog", 0, "jobs waiting in the table (scheduled a day ahead) while the run goes")
	fs.IntVar(&o.finalRows, "final-rows", 0, "final jobs (with their attempts) in the table before the run, as retention keeps them")
	fs.BoolVar(&o.expired, "expired", false, "with --final-rows: make them older than retention, so the sweeper prunes them during the run (its rate is printed)")
	fs.BoolVar(&o.dbProfile, "db-profile", false, "print where PostgreSQL's time went, per statement family (pg_stat_statements); with --citus-workers, per node")
	fs.IntVar(&o.citusWorkers, "citus-workers", 0, "run on a throwaway local Citus cluster of a coordinator and this many workers (Citus installed beside PostgreSQL)")
	fs.BoolVar(&o.citusOnWorker, "citus-on-worker", false, "with --citus-workers: connect the hipq instances to the worker that holds the bench's queue, not to the coordinator")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the first hipq instance to this file")
	fs.StringVar(&o.memProfile, "memprofile", "", "write a heap profile of the first hipq instance, at its heap's peak, to this file")
	fs.IntVar(&o.throttle, "throttle-limit", 0, "give the queue this throttle_limit (0 = unlimited), to measure what limits cost")
	fs.BoolVar(&o.shares, "shares", false, "with --throttle-limit: split the limit into three equal shares by job_data /r")
	fs.IntVar(&o.rateLimit, "rate-limit", 0, "give the queue a rate limit of this many requests per second (0 = none), to measure what rates cost")
	fs.StringVar(&o.intake, "intake", "kafka", "how jobs come in: kafka (records to the intake topic) or outbox (rows of hipq_intake, 4 writers, --outbox-batch rows per transaction)")
	fs.IntVar(&o.outboxBatch, "outbox-batch", 100, "with --intake outbox: rows per application transaction")
	fs.BoolVar(&o.events, "events", false, "publish each job's outcome event (events.topic), and end the run once every one reached Kafka, to measure what events cost")
	memoryLimit := fs.String("memory-limit", "", "the instances' memory_limit (such as 64MiB; default: as hipq run resolves it, GOMEMLIMIT, the cgroup's or 64MiB)")
	if err := fs.Parse(args); err != nil {
		return nil, &exitError{2, err}
	}
	if *memoryLimit != "" {
		n, err := memlimit.ParseSize(*memoryLimit)
		switch {
		case err != nil:
			return nil, &exitError{2, fmt.Errorf("--memory-limit: %w", err)}
		case n < memlimit.Min:
			return nil, &exitError{2, fmt.Errorf("--memory-limit: %s is below the minimum of %s", memlimit.Format(n), memlimit.Format(memlimit.Min))}
		}
		o.memoryLimit = n
	}
	bad := func(format string, a ...any) (*benchOpts, error) { return nil, &exitError{2, fmt.Errorf(format, a...)} }
	switch {
	case o.intake != "kafka" && o.intake != "outbox":
		return bad("--intake: %q is not kafka or outbox", o.intake)
	case o.outboxBatch < 1:
		return bad("--outbox-batch: must be at least 1")
	case o.n < 1:
		return bad("-n: must be at least 1")
	case o.instances < 1 || o.instances > 16:
		return bad("--instances: %d is not between 1 and 16", o.instances)
	case o.rate < 0 || o.rate > 1e6:
		return bad("--rate: %v is not between 0 and 1000000 jobs/s", o.rate)
	case o.rate > 0 && o.duration <= 0:
		return bad("--duration: must be positive")
	case o.backlog < 0 || o.finalRows < 0:
		return bad("--backlog and --final-rows must not be negative")
	case o.expired && o.finalRows == 0:
		return bad("--expired needs --final-rows")
	case o.shares && o.throttle < 1:
		return bad("--shares needs --throttle-limit")
	case o.rateLimit < 0:
		return bad("--rate-limit %d must not be negative", o.rateLimit)
	case o.citusWorkers < 0 || o.citusWorkers > 16:
		return bad("--citus-workers: %d is not between 0 and 16", o.citusWorkers)
	case o.citusOnWorker && o.citusWorkers == 0:
		return bad("--citus-on-worker needs --citus-workers")
	}
	if o.rate > 0 {
		o.n = max(int(o.rate*o.duration.Seconds()), 1)
	}
	return o, nil
}

// cmdBench runs jobs end to end through hipq and prints what it measured.
// The bench process holds the embedded Kafka, the producer and the
// responder; each hipq instance is a process of its own (hipq run), so its
// memory is its own, and the bench watches them through their /metrics,
// never by counting rows in the database it measures.
func cmdBench(args []string, stdout io.Writer) error {
	o, err := parseBench(args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	db := sandboxDB{durable: true, citusWorkers: o.citusWorkers}
	if o.dbProfile {
		// On Citus, every node alike (Citus adds itself first).
		db.settings = map[string]string{"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "top"}
	}
	topics := []string{"hipq.jobs", "bench.requests", "bench.responses"}
	if o.events {
		topics = append(topics, "bench.events")
	}
	sb, err := newSandboxWith(ctx, db, int32(o.partitions), topics...)
	if err != nil {
		return err
	}
	defer sb.close()
	conf := benchConfig
	if o.events {
		conf += "events: {topic: bench.events}\n"
	}
	if o.throttle > 0 || o.rateLimit > 0 {
		extra := ""
		if o.shares {
			extra = ", shares: {by: {json: /r}, weights: {a: 1, b: 1, c: 1}}"
		}
		if o.rateLimit > 0 {
			extra += fmt.Sprintf(", rates: [{limit: %d, period: 1s}]", o.rateLimit)
		}
		conf += fmt.Sprintf("queues:\n  - {name: default, throttle_limit: %d%s}\n", o.throttle, extra)
	}
	if o.expired {
		conf = strings.Replace(conf, `sweeper: {schedule: "@every 5s"}`, `sweeper: {schedule: "@every 1s", retention: 1h}`, 1)
	}
	if o.memoryLimit > 0 {
		conf += fmt.Sprintf("memory_limit: %d\n", o.memoryLimit)
	}
	schema := fmt.Sprintf("hipq_bench_%d", time.Now().UnixNano())
	cfg, err := sb.config(conf, schema)
	if err != nil {
		return err
	}
	st, err := openStore(ctx, cfg)
	if err != nil {
		return err
	}
	defer st.Close()
	if _, err := st.Migrate(ctx); err != nil {
		return err
	}
	if !sb.throwaway() {
		defer func() { _ = st.DropSchema(context.Background()) }()
	}

	limits := "no throttle"
	if o.throttle > 0 {
		limits = fmt.Sprintf("throttle_limit %d", o.throttle)
		if o.shares {
			limits += " in three shares"
		}
	}
	if o.rateLimit > 0 {
		limits = strings.TrimPrefix(limits+fmt.Sprintf(", rate limit %d/s", o.rateLimit), "no throttle, ")
	}
	from := "Kafka intake"
	if o.intake == "outbox" {
		from = fmt.Sprintf("outbox (transactions of %d rows)", o.outboxBatch)
	}
	load := fmt.Sprintf("%d jobs at once", o.n)
	if o.rate > 0 {
		load = fmt.Sprintf("%.0f jobs/s for %v (%d jobs)", o.rate, o.duration, o.n)
	}
	end := "final"
	if o.events {
		end = "final → outcome event on Kafka"
	}
	fmt.Fprintf(stdout, "hipq bench: %s, %s → dispatch → responder → match → %s, embedded Kafka (%d partitions), %d hipq instance(s), %s, %s\n",
		load, from, end, o.partitions, o.instances, sb.dbDescription(), limits)
	if o.backlog > 0 || o.finalRows > 0 {
		seedStart := time.Now()
		finalAt := time.Now().Add(-time.Minute)
		if o.expired {
			finalAt = time.Now().Add(-2 * time.Hour) // past the bench's 1h retention
		}
		err := st.BenchSeed(ctx, "default", "bench.noop", o.backlog, o.finalRows, finalAt, func(what string, done int) {
			if !o.asJSON || done%1000000 == 0 {
				fmt.Fprintf(stdout, "  seeded %d %s\n", done, what)
			}
		})
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "  table seeded in %.0fs: %d waiting a day ahead, %d final%s\n", time.Since(seedStart).Seconds(),
			o.backlog, o.finalRows, map[bool]string{true: " (past retention: pruned during the run)"}[o.expired])
	}

	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	resp, err := newResponder(sb.brokers, "bench-responder", "bench.requests", "bench.responses",
		func(string, int) (string, bool) { return "succeeded", true })
	if err != nil {
		return err
	}
	go resp.run(runCtx)
	instanceURL := sb.dbURL
	if o.citusOnWorker {
		if instanceURL, err = queueNodeURL(ctx, st, sb.nodes(), "default"); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "  hipq instances connected to the worker that holds the queue\n")
	}
	insts, err := startInstances(ctx, sb, instanceURL, conf, schema, o)
	defer stopInstances(insts) // those that started, if not all did
	if err != nil {
		return err
	}
	// The run starts once every consumer group has shared its partitions
	// among the instances: a second instance joining rebalances the
	// groups about a second after it starts, which a run of a few seconds
	// would otherwise count as throughput.
	groups := []string{"hipq-bench-responses"}
	if o.intake == "kafka" {
		groups = append(groups, "hipq-bench-intake")
	}
	if err := waitBalanced(ctx, insts, groups, o.partitions); err != nil {
		return err
	}

	prod, err := kgo.NewClient(kgo.SeedBrokers(sb.brokers...), kgo.ProducerLinger(5*time.Millisecond))
	if err != nil {
		return err
	}
	defer prod.Close()
	var profileErr error
	var nodes []*profiledNode
	if o.dbProfile {
		profileErr = st.StatementsReset(ctx)
		if profileErr == nil {
			nodes, profileErr = resetNodes(ctx, sb.nodes(), st)
		}
		defer closeNodes(nodes)
	}
	start := time.Now()
	value := func(i int) string {
		return fmt.Sprintf(`{"job_type":"bench.noop","job_key":"k%d","job_data":{"t":%d,"r":"%c"}}`, i, time.Now().UnixNano(), 'a'+i%3)
	}
	writeErr := make(chan error, 4)
	switch {
	case o.intake == "kafka" && o.rate > 0:
		// Open loop: the i-th job leaves at start + i/rate, whatever hipq does.
		go func() {
			for i := 0; i < o.n && ctx.Err() == nil; {
				due := min(int(time.Since(start).Seconds()*o.rate)+1, o.n)
				for ; i < due; i++ {
					prod.Produce(ctx, &kgo.Record{Topic: "hipq.jobs", Key: []byte("k" + strconv.Itoa(i)), Value: []byte(value(i))}, nil)
				}
				time.Sleep(time.Millisecond)
			}
			prod.Flush(ctx)
		}()
	case o.intake == "kafka":
		go func() {
			for i := range o.n {
				prod.Produce(ctx, &kgo.Record{Topic: "hipq.jobs", Key: []byte("k" + strconv.Itoa(i)), Value: []byte(value(i))}, nil)
			}
			prod.Flush(ctx)
		}()
	default:
		// Applications: 4 writers, each committing transactions of
		// outbox-batch rows (at --rate, paced like the Kafka producer).
		const writers = 4
		for w := range writers {
			go func() {
				for lo := w * o.outboxBatch; lo < o.n; lo += writers * o.outboxBatch {
					if o.rate > 0 {
						time.Sleep(time.Until(start.Add(time.Duration(float64(lo) / o.rate * float64(time.Second)))))
					}
					vals := make([]string, 0, o.outboxBatch)
					for i := lo; i < min(lo+o.outboxBatch, o.n); i++ {
						vals = append(vals, value(i))
					}
					if err := st.OutboxWrite(ctx, vals); err != nil {
						writeErr <- err
						return
					}
				}
			}()
		}
	}
	// Done when the instances together have seen n replies end an attempt
	// (every bench job ends at its first).
	var pruned float64
	for {
		m, err := scrapeInstances(ctx, insts)
		if err != nil {
			return err
		}
		pruned = m["hipq_sweeper_actions_total{action=\"pruned\"}"]
		events := m[`hipq_events_total{result="sent",topic="bench.events"}`]
		if int(m["hipq_round_trip_seconds_count"]) >= o.n && (!o.events || int(events) >= o.n) {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("bench did not finish: %.0f of %d jobs ended", m["hipq_round_trip_seconds_count"], o.n)
		case err := <-writeErr:
			return err
		case in := <-exited(insts):
			return fmt.Errorf("hipq instance %d stopped: %v", in.n, in.err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	res := benchResult{Jobs: o.n, Instances: o.instances, Rate: o.rate, Backlog: o.backlog, FinalRows: o.finalRows, Events: o.events,
		CitusWorkers: o.citusWorkers}
	for _, in := range insts {
		res.PeakRSSBytes = max(res.PeakRSSBytes, in.peakRSS())
		limit, err := in.gauge(ctx, "hipq_memory_limit_bytes")
		if err != nil {
			return err
		}
		res.MemoryLimitBytes = max(res.MemoryLimitBytes, int64(limit))
	}
	var profile []store.StatementTime
	if o.dbProfile && profileErr == nil {
		profile, profileErr = st.StatementsRead(ctx)
		for _, nd := range nodes {
			if profileErr == nil {
				nd.profile, profileErr = nd.st.StatementsRead(ctx)
			}
		}
	}
	lat, err := st.BenchLatencies(ctx, "bench.noop")
	if err != nil {
		return err
	}
	res.P50ms, res.P99ms, res.MaxMs = lat.P50, lat.P99, lat.Max
	res.SlowestSecond, res.SlowestP99ms = lat.SlowestSecond+1, lat.SlowestP99
	last, stages := lat.Last, [3][2]float64{lat.Intake, lat.Claim, lat.Reply}
	res.Seconds = last.Sub(start).Seconds()
	if o.events {
		// Every event relayed, not only every job final: the run ends when
		// the last event was produced.
		produced, records, err := lastEventProduced(ctx, sb.brokers, "bench.events")
		if err != nil {
			return err
		}
		if records < int64(o.n) {
			return fmt.Errorf("bench.events holds %d records for %d jobs", records, o.n)
		}
		end := last
		if produced.After(end) {
			end = produced
		}
		res.Seconds = end.Sub(start).Seconds()
		res.EventsTailMs = float64(end.Sub(last).Microseconds()) / 1000
	}
	res.JobsPerSec = float64(o.n) / res.Seconds
	if o.expired {
		res.PrunedPerSec = pruned / time.Since(start).Seconds()
	}
	fmt.Fprintf(stdout, "  %d jobs in %.2fs: %.0f jobs/s; round trip p50 %.1f ms, p99 %.1f ms, max %.1f ms\n",
		res.Jobs, res.Seconds, res.JobsPerSec, res.P50ms, res.P99ms, res.MaxMs)
	if o.events {
		fmt.Fprintf(stdout, "  every event on Kafka %.0f ms after the last job ended\n", res.EventsTailMs)
	}
	fmt.Fprintf(stdout, "  peak RSS %.1f MiB per hipq instance (largest of %d) against a memory limit of %s: %.0f%% of it\n",
		float64(res.PeakRSSBytes)/(1<<20), o.instances, memlimit.Format(res.MemoryLimitBytes), 100*float64(res.PeakRSSBytes)/float64(max(res.MemoryLimitBytes, 1)))
	fmt.Fprintf(stdout, "  where jobs waited, p50/p99 ms: produce→stored %.0f/%.0f, stored→claimed %.0f/%.0f, claimed→final %.0f/%.0f; slowest second: the %s (p99 %.1f ms)\n",
		stages[0][0], stages[0][1], stages[1][0], stages[1][1], stages[2][0], stages[2][1], ordinal(res.SlowestSecond), res.SlowestP99ms)
	if o.expired {
		fmt.Fprintf(stdout, "  retention prune: %.0f rows/s over the run (%.0f of %d past retention)\n", res.PrunedPerSec, pruned, o.finalRows)
	}
	switch {
	case o.dbProfile && len(nodes) > 0 && profileErr == nil:
		fmt.Fprintln(stdout, "  db profile per node (pg_stat_statements, top-level statements; the coordinator's include waiting for the workers):")
		for _, nd := range nodes {
			p := printProfile(stdout, nd.name, nd.profile, nil, o.n)
			res.DBProfileNodes = append(res.DBProfileNodes, p)
		}
		res.StatementUsPerJob = res.DBProfileNodes[0].StatementUsPerJob
	case o.dbProfile:
		res.StatementUsPerJob = printProfile(stdout, "", profile, profileErr, o.n).StatementUsPerJob
	}
	if o.asJSON {
		b, _ := json.Marshal(res)
		fmt.Fprintln(stdout, string(b))
	}
	return nil
}

// printProfile prints PostgreSQL's statement time per family and per job,
// of node (named, on Citus) or of the one server (""), and returns it.
func printProfile(w io.Writer, node string, profile []store.StatementTime, err error, n int) nodeProfile {
	if err != nil {
		fmt.Fprintf(w, "  db profile: none (%v); with $HIPQ_DATABASE_URL the server needs shared_preload_libraries = pg_stat_statements\n", err)
		return nodeProfile{}
	}
	var total float64
	for _, p := range profile {
		total += p.Millis
	}
	out := nodeProfile{Node: node, StatementUsPerJob: total * 1000 / float64(n), Families: []familyProfile{}}
	if node == "" {
		fmt.Fprintf(w, "  db profile (pg_stat_statements, top-level statements): %.0f ms in all, %.1f µs per job\n", total, out.StatementUsPerJob)
	} else {
		fmt.Fprintf(w, "  %s: %.0f ms in all, %.1f µs per job\n", node, total, out.StatementUsPerJob)
	}
	fmt.Fprintf(w, "    %-34s %8s %10s %10s %8s %6s\n", "family", "calls", "rows", "ms", "µs/job", "share")
	for _, p := range profile {
		f := familyProfile{Family: p.Family, Calls: p.Calls, Rows: p.Rows, Ms: p.Millis, UsPerJob: p.Millis * 1000 / float64(n)}
		out.Families = append(out.Families, f)
		fmt.Fprintf(w, "    %-34s %8d %10d %10.0f %8.1f %5.1f%%\n", f.Family, f.Calls, f.Rows, f.Ms, f.UsPerJob, 100*p.Millis/max(total, 1))
	}
	return out
}

// profiledNode is one node of a Citus cluster whose statements a bench
// run profiles.
type profiledNode struct {
	name    string
	st      *store.Store // on the node itself; only its statements' profile is read
	profile []store.StatementTime
}

// resetNodes starts the profile of each node (coordinator is the store on
// the first, whose profile is already reset): the workers' statements are
// those the coordinator and the instances send to their shards.
func resetNodes(ctx context.Context, nodes []sandboxNode, coordinator *store.Store) ([]*profiledNode, error) {
	var out []*profiledNode
	for i, nd := range nodes {
		p := &profiledNode{name: nd.name, st: coordinator}
		if i > 0 {
			st, err := store.Open(ctx, store.Config{URL: nd.url, MaxConns: 2, Citus: store.CitusOff})
			if err != nil {
				closeNodes(out)
				return nil, fmt.Errorf("%s: %w", nd.name, err)
			}
			p.st = st
			if err := st.StatementsReset(ctx); err != nil {
				closeNodes(append(out, p))
				return nil, fmt.Errorf("%s: %w", nd.name, err)
			}
		}
		out = append(out, p)
	}
	return out, nil
}

// closeNodes closes the workers' stores (the coordinator's is the bench's).
func closeNodes(nodes []*profiledNode) {
	for i, nd := range nodes {
		if i > 0 {
			nd.st.Close()
		}
	}
}

// ordinal spells n as "1st", "2nd", "3rd", "4th", ...
func ordinal(n int) string {
	suffix := "th"
	switch {
	case n%100 >= 11 && n%100 <= 13:
	case n%10 == 1:
		suffix = "st"
	case n%10 == 2:
		suffix = "nd"
	case n%10 == 3:
		suffix = "rd"
	}
	return strconv.Itoa(n) + suffix
}

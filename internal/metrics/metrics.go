// Package metrics holds hipq's Prometheus metrics. Every component counts
// into one Metrics; the API serves it at /metrics. The names and labels are
// the documented contract (docs/operations.md): rename nothing lightly.
package metrics

import (
	"context"
	"maps"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/hipq/hipq/correlator"
)

// Metrics is one process's metrics, in their own registry.
type Metrics struct {
	reg *prometheus.Registry

	// IntakeRecords counts job requests by source (kafka, api, replay) and result
	// (accepted, duplicate, dead_lettered; conflict for the API's 409).
	IntakeRecords *prometheus.CounterVec
	// Claimed counts jobs the dispatcher moved to running, by queue.
	Claimed *prometheus.CounterVec
	// ClaimRounds counts the dispatcher's rounds by queue and result:
	// claimed (a claim found jobs), empty (a claim found none),
	// nothing_due (no job was due: no claim was asked).
	ClaimRounds *prometheus.CounterVec
	// Dispatches counts sends by queue, transport (kafka, http) and result:
	// sent, refused (never left; claim undone), unknown (may have left:
	// claim undone, or failed for at_most_once), failed (dispatch_error).
	Dispatches *prometheus.CounterVec
	// Deferred counts due jobs found outside their time windows, by queue
	// and result (deferred, expired).
	Deferred *prometheus.CounterVec
	// Replies counts replies by source (kafka, callback, sync, early, replay) and
	// result (applied, duplicate, stale, early, dead_lettered).
	Replies *prometheus.CounterVec
	// RoundTrip observes, per job type, the seconds from a job's claim to
	// the reply that ended its attempt.
	RoundTrip *prometheus.HistogramVec
	// Sweeper counts the sweeper's actions (timed_out, rescued,
	// failed_unsent, expired, early_applied, early_dead_lettered, pruned,
	// dead_letters_pruned).
	Sweeper *prometheus.CounterVec
	// Waits counts the API's long polls for a job to end, by result
	// (final, timeout, gone: the caller left).
	Waits *prometheus.CounterVec
	// ScheduleFires counts schedule ticks by schedule and result
	// (enqueued, duplicate, skipped, missed, failed).
	ScheduleFires *prometheus.CounterVec
	// Stalled is 1 while a consumer (a consumer group, or the outbox
	// drainer as group "outbox") waits because PostgreSQL refuses its
	// records for a reason that is not theirs (or a record alone, with
	// none after it to compare with, for long), by the SQLSTATE of the
	// refusal (reason); 0 once it flows again.
	Stalled *prometheus.GaugeVec
	// EventsPending is the outcome events waiting in PostgreSQL to be
	// relayed, by topic, as the relaying instance last counted them (the
	// other instances report none).
	EventsPending *prometheus.GaugeVec
	// Events counts outcome events the relay produced, by topic and
	// result: sent (acknowledged by the broker), refused (the topic
	// refused it: it waits and is sent again), result_omitted (sent without
	// its result, which made it larger than the broker takes).
	Events *prometheus.CounterVec
	// MemoryLimit is the memory the process holds itself to
	// (memory_limit, GOMEMLIMIT, 90% of its cgroup's, or the default).
	MemoryLimit prometheus.Gauge

	lag *lagCollector
}

// New builds the metrics, with Go runtime and process collectors.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		IntakeRecords: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_intake_records_total",
			Help: "Job requests read, by source (kafka, api, replay) and result (accepted, duplicate, dead_lettered, conflict)."},
			[]string{"source", "result"}),
		Claimed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_jobs_claimed_total",
			Help: "Jobs the dispatcher moved to running, by queue."}, []string{"queue"}),
		ClaimRounds: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_claim_rounds_total",
			Help: "Dispatcher rounds by queue and result: claimed (a claim found jobs), empty (it found none), nothing_due (no claim asked)."},
			[]string{"queue", "result"}),
		Dispatches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_dispatches_total",
			Help: "Sends by queue, transport (kafka, http) and result (sent, refused, unknown, failed)."},
			[]string{"queue", "transport", "result"}),
		Deferred: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_jobs_deferred_total",
			Help: "Due jobs found outside their time windows, by queue and result (deferred, expired)."},
			[]string{"queue", "result"}),
		Replies: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_replies_total",
			Help: "Replies by source (kafka, callback, sync, early, replay) and result (applied, duplicate, stale, early, dead_lettered)."},
			[]string{"source", "result"}),
		RoundTrip: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "hipq_round_trip_seconds",
			Help:    "Seconds from a job's claim to the reply that ended its attempt, by job type.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600}},
			[]string{"job_type"}),
		Sweeper: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_sweeper_actions_total",
			Help: "What the sweeper did, by action (timed_out, rescued, failed_unsent, expired, early_applied, early_dead_lettered, pruned, dead_letters_pruned)."},
			[]string{"action"}),
		Waits: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_api_waits_total",
			Help: "Long polls for a job to end (GET /v1/jobs/{type}/{key}?job_id=&wait=), by result (final, timeout, gone)."},
			[]string{"result"}),
		ScheduleFires: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_schedule_fires_total",
			Help: "Schedule ticks by schedule and result (enqueued, duplicate: a non-final job had the key, skipped: overlap, missed: left out by catch_up, failed)."},
			[]string{"schedule", "result"}),
		Stalled: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "hipq_consumer_stalled",
			Help: "1 while a consumer group (or the outbox drainer, group outbox) waits because PostgreSQL refuses its records for a reason not theirs (or one record, alone, for long), by SQLSTATE (reason); 0 once it flows again."},
			[]string{"group", "reason"}),
		EventsPending: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "hipq_events_pending",
			Help: "Outcome events waiting in PostgreSQL to be relayed to Kafka, by topic (reported by the relaying instance)."},
			[]string{"topic"}),
		Events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "hipq_events_total",
			Help: "Outcome events relayed, by topic and result (sent, refused: it waits and is sent again, result_omitted: sent without its too large result)."},
			[]string{"topic", "result"}),
		MemoryLimit: prometheus.NewGauge(prometheus.GaugeOpts{Name: "hipq_memory_limit_bytes",
			Help: "The memory the process holds itself to: memory_limit, else GOMEMLIMIT, else 90% of its cgroup's limit, else 64 MiB."}),
		lag: &lagCollector{groups: map[string]func(context.Context) ([]PartitionLag, error){},
			desc: prometheus.NewDesc("hipq_consumer_lag_records",
				"Records between a partition's end offset and the next offset this instance applies, by consumer group; partitions assigned here only.",
				[]string{"group", "topic", "partition"}, nil)},
	}
	m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.IntakeRecords, m.Claimed, m.ClaimRounds, m.Dispatches, m.Deferred, m.Replies, m.RoundTrip, m.Sweeper, m.Waits, m.ScheduleFires, m.Stalled,
		m.EventsPending, m.Events, m.MemoryLimit, m.lag)
	return m
}

// Or returns m, or fresh metrics nobody serves when m is nil, so a
// component built without metrics still counts.
func Or(m *Metrics) *Metrics {
	if m == nil {
		return New()
	}
	return m
}

// Handler serves the metrics in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// Registry is where the metrics live (tests gather from it).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// CountJobs registers hipq_jobs{queue,state}, read from PostgreSQL at
// scrape time with count, of the non-final states only (final rows are
// what retention keeps: millions, never counted). Every non-final state of
// every queue in queues (and of any other queue found) is reported, 0
// included. A count is a scan of
// hipq_job, so a result is reused for minAge; a scrape that cannot count
// reports no hipq_jobs and bumps hipq_jobs_count_errors_total rather than
// show stale figures.
func (m *Metrics) CountJobs(count func(context.Context) ([]correlator.JobCount, error), queues []string, minAge time.Duration) {
	c := &jobsCollector{count: count, queues: queues, minAge: minAge,
		desc: prometheus.NewDesc("hipq_jobs", "Jobs in PostgreSQL by queue and state.", []string{"queue", "state"}, nil),
		errs: prometheus.NewCounter(prometheus.CounterOpts{Name: "hipq_jobs_count_errors_total",
			Help: "Scrapes whose job count failed (PostgreSQL unreachable or too slow)."})}
	m.reg.MustRegister(c, c.errs)
}

type jobsCollector struct {
	count  func(context.Context) ([]correlator.JobCount, error)
	queues []string
	minAge time.Duration
	desc   *prometheus.Desc
	errs   prometheus.Counter

	mu   sync.Mutex
	last []correlator.JobCount
	at   time.Time
}

func (c *jobsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *jobsCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() || time.Since(c.at) >= c.minAge {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		counts, err := c.count(ctx)
		cancel()
		if err != nil {
			c.errs.Inc()
			c.last, c.at = nil, time.Time{}
			return
		}
		c.last, c.at = c.fill(counts), time.Now()
	}
	for _, jc := range c.last {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(jc.N), jc.Queue, string(jc.State))
	}
}

// fill adds a 0 for every state of every known queue the count missed.
func (c *jobsCollector) fill(counts []correlator.JobCount) []correlator.JobCount {
	seen := map[[2]string]bool{}
	queues := append([]string(nil), c.queues...)
	for _, jc := range counts {
		seen[[2]string{jc.Queue, string(jc.State)}] = true
		queues = append(queues, jc.Queue)
	}
	for _, q := range queues {
		for _, st := range correlator.States {
			if st == correlator.StateFinal {
				continue
			}
			if !seen[[2]string{q, string(st)}] {
				seen[[2]string{q, string(st)}] = true
				counts = append(counts, correlator.JobCount{Queue: q, State: st})
			}
		}
	}
	return counts
}

// Sources: the source label of hipq_intake_records_total (kafka, outbox,
// api, replay) and of hipq_replies_total (kafka, callback, sync, heartbeat, early, replay).
const (
	SourceAPI       = "api"
	SourceKafka     = "kafka"
	SourceOutbox    = "outbox" // rows of hipq_intake, the transactional outbox
	SourceCallback  = "callback"
	SourceSync      = "sync"
	SourceHeartbeat = "heartbeat" // POSTs to Hipq-Heartbeat-Url
	SourceEarly     = "early"     // kept early replies applied or expired later
	SourceReplay    = "replay"    // dead letters replayed through the API
)

// ObserveReplies counts what a reply batch did and the round trips of the
// attempts it ended.
func (m *Metrics) ObserveReplies(source string, counts map[correlator.Verdict]int, trips []correlator.RoundTrip) {
	for v, n := range counts {
		if n > 0 {
			m.Replies.WithLabelValues(source, verdict(v)).Add(float64(n))
		}
	}
	for _, rt := range trips {
		m.RoundTrip.WithLabelValues(rt.JobType).Observe(rt.Elapsed.Seconds())
	}
}

func verdict(v correlator.Verdict) string {
	if v == correlator.DeadLetter {
		return "dead_lettered"
	}
	return v.String()
}

// PartitionLag is how many records of one partition wait to be applied.
type PartitionLag struct {
	Topic     string
	Partition int32
	Records   int64
}

// ReportLag registers a consumer group's lag, asked at scrape time.
func (m *Metrics) ReportLag(group string, lag func(context.Context) ([]PartitionLag, error)) {
	m.lag.mu.Lock()
	m.lag.groups[group] = lag
	m.lag.mu.Unlock()
}

type lagCollector struct {
	desc   *prometheus.Desc
	mu     sync.Mutex
	groups map[string]func(context.Context) ([]PartitionLag, error)
}

func (c *lagCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect asks every group; a group whose brokers do not answer within 5s
// reports nothing (absent, not 0).
func (c *lagCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	groups := maps.Clone(c.groups)
	c.mu.Unlock()
	for group, lag := range groups {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		lags, err := lag(ctx)
		cancel()
		if err != nil {
			continue
		}
		for _, l := range lags {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(l.Records), group, l.Topic, strconv.Itoa(int(l.Partition)))
		}
	}
}

// Value reads the series of name whose labels include labels: a counter's
// or gauge's value, a histogram's observation count, summed over the
// matching series. ok is false when no series matches. Tests read metrics
// with it.
func (m *Metrics) Value(name string, labels map[string]string) (v float64, ok bool) {
	mfs, err := m.reg.Gather()
	if err != nil {
		return 0, false
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, s := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range s.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, want := range labels {
				if have[k] != want {
					continue series
				}
			}
			ok = true
			switch {
			case s.Counter != nil:
				v += s.GetCounter().GetValue()
			case s.Gauge != nil:
				v += s.GetGauge().GetValue()
			case s.Histogram != nil:
				v += float64(s.GetHistogram().GetSampleCount())
			}
		}
	}
	return v, ok
}

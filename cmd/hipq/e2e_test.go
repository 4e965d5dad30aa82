package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

const e2eConfig = `
name: e2e
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"], session_timeout: 6s}
intake: {topics: ["{{T:jobs}}"], dead_letter_topic: "{{T:jobs.dlq}}", max_bytes: 2048}
responses: {topics: [{topic: "{{T:replies}}"}], dead_letter_topic: "{{T:replies.dlq}}", early_ttl: 1m}
dispatch: {interval: 100ms, batch_size: 50, grace: 1s}
sweeper: {schedule: "@every 1s"}
job_types:
  - name: e2e
    transport: {kafka: {topic: "{{T:requests}}"}}
    reply_topic: "{{T:replies}}"
    timeout: 2s
    retry: {max_attempts: 3, backoff: fixed, initial: 200ms, jitter: 0}
`

var e2eTopics = []string{"jobs", "jobs.dlq", "requests", "replies", "replies.dlq"}

// The whole loop: intake → dispatch → reply → final, with a failure
// retried, a reply that never comes timed out and retried, and a job whose
// retries run out.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	a := e.start(e.config(e2eConfig))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.respond(ctx, "requests", "replies", func(key string, attempt int) (string, bool) {
		switch {
		case strings.HasPrefix(key, "fail-once") && attempt == 1:
			return "failed", true
		case strings.HasPrefix(key, "silent-once") && attempt == 1:
			return "", false
		case strings.HasPrefix(key, "always-fail"):
			return "failed", true
		}
		return "succeeded", true
	})
	var reqs []string
	for i := range 20 {
		reqs = append(reqs, jobReq(fmt.Sprintf("ok-%d", i)))
	}
	reqs = append(reqs, jobReq("fail-once"), jobReq("silent-once"), jobReq("always-fail"))
	e.produce("jobs", reqs...)
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(a, "state = 'final'")
		return n == 23, fmt.Sprintf("%d final", n)
	}, "all jobs final")
	check := func(key string, outcome correlator.Outcome, attempt int) {
		j, err := a.st.JobGet(ctx, "e2e", key)
		if err != nil {
			t.Fatal(err)
		}
		if j.Outcome != outcome || j.Attempt != attempt {
			t.Errorf("%s: outcome %s attempt %d, want %s %d", key, j.Outcome, j.Attempt, outcome, attempt)
		}
	}
	check("ok-3", correlator.OutcomeSucceeded, 1)
	check("fail-once", correlator.OutcomeSucceeded, 2)
	check("silent-once", correlator.OutcomeSucceeded, 2)
	check("always-fail", correlator.OutcomeFailed, 3)
	var timedOut int
	_ = a.st.Pool().QueryRow(ctx, "SELECT count(*) FROM hipq_attempt WHERE outcome = 'timed_out'").Scan(&timedOut)
	if timedOut != 1 {
		t.Errorf("%d timed-out attempts, want 1", timedOut)
	}
	if n := e.countJobs(a, "attempt > max_attempts"); n != 0 {
		t.Errorf("%d jobs above max_attempts", n)
	}
	// The metrics moved with the jobs: 23 accepted; 27 sends (silent-once
	// twice); 26 replies applied, each with its round trip; 1 timeout; all
	// 23 final; no lag left on either consumer group.
	m := scrape(t, a.metrics.Handler())
	wantMetrics(t, m, map[string]float64{
		`hipq_intake_records_total{result="accepted",source="kafka"}`:                                       23,
		`hipq_jobs_claimed_total{queue="default"}`:                                                          27,
		`hipq_dispatches_total{queue="default",result="sent",transport="kafka"}`:                            27,
		`hipq_replies_total{result="applied",source="kafka"}`:                                               26,
		`hipq_round_trip_seconds_count{job_type="e2e"}`:                                                     26,
		`hipq_sweeper_actions_total{action="timed_out"}`:                                                    1,
		`hipq_jobs{queue="default",state="running"}`:                                                        0,
		`hipq_consumer_lag_records{group="e2e-intake",partition="0",topic="` + e.kafka.Topic("jobs") + `"}`: 0,
	})
	lags := 0
	for series, v := range m {
		if strings.HasPrefix(series, "hipq_consumer_lag_records{") {
			lags++
			if v != 0 {
				t.Errorf("%s = %v after every record was applied", series, v)
			}
		}
	}
	if lags < 2 {
		t.Errorf("consumer lag reported for %d partitions, want intake's and responses'", lags)
	}
}

// Every bad-input case of SPEC §4 is dead-lettered, to PostgreSQL and to
// the dead-letter topic with a hipq-error header, and never blocks the
// partition: good records after bad ones become jobs.
func TestIntakeBadInputIsDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	cfg := e.config(e2eConfig)
	a := e.start(cfg, "intake")
	bad := map[string]string{
		"not json":         `{{{`,
		"not an object":    `[1,2]`,
		"missing key":      `{"job_type":"e2e"}`,
		"ill-typed":        `{"job_type":"e2e","job_key":"k1","priority":"high"}`,
		"unknown field":    `{"job_type":"e2e","job_key":"k2","job_kye":"typo"}`,
		"unknown job type": `{"job_type":"nope","job_key":"k3"}`,
		"too large":        `{"job_type":"e2e","job_key":"k4","job_data":"` + strings.Repeat("x", 3000) + `"}`,
		"too deep":         `{"job_type":"e2e","job_key":"k5","job_data":` + strings.Repeat("[", 70) + strings.Repeat("]", 70) + `}`,
		"invalid UTF-8":    "{\"job_type\":\"e2e\",\"job_key\":\"k6\xff\"}",
		"NUL":              `{"job_type":"e2e","job_key":"k7","job_data":"a\u0000b"}`,
	}
	var vals []string
	for _, v := range bad {
		vals = append(vals, v)
	}
	vals = append(vals, jobReq("good-1"), `{"job_type":"e2e","job_key":"good-1","job_data":{"other":1}}`, jobReq("good-1"), jobReq("good-2"))
	e.produce("jobs", vals...)
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		n := e.countJobs(a, "true")
		return n == 2, fmt.Sprintf("%d jobs", n)
	}, "good jobs stored")
	wantDead := len(bad) + 1 // plus the conflict
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		var n int
		_ = a.st.Pool().QueryRow(context.Background(), "SELECT count(*) FROM hipq_dead_letter WHERE source = 'intake'").Scan(&n)
		return n == wantDead, fmt.Sprintf("%d dead letters", n)
	}, "dead letters stored")
	dls, err := a.st.DeadLetterList(context.Background(), store.DeadLetterListParams{Kind: store.SourceIntake})
	if err != nil {
		t.Fatal(err)
	}
	codes := map[string]bool{}
	for _, d := range dls {
		code, _, _ := strings.Cut(d.Reason, ":")
		codes[code] = true
		if d.Source.Topic == "" || len(d.Source.Value) == 0 {
			t.Errorf("dead letter without its record: %+v", d)
		}
	}
	for _, c := range []string{correlator.CodeInvalidJSON, correlator.CodeNotObject, correlator.CodeMissingField, correlator.CodeInvalidField,
		correlator.CodeUnknownField, correlator.CodeUnknownJobType, correlator.CodeTooLarge, correlator.CodeTooDeep,
		correlator.CodeInvalidUTF8, correlator.CodeNullChar, correlator.CodeConflict} {
		if !codes[c] {
			t.Errorf("no dead letter with reason %s (have %v)", c, codes)
		}
	}
	// The dead-letter topic gets copies with the reason in hipq-error.
	cl := e.kafka.Client(kgo.ConsumeTopics(e.kafka.Topic("jobs.dlq")), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer cl.Close()
	got := 0
	deadline := time.Now().Add(15 * time.Second)
	for got < wantDead && time.Now().Before(deadline) {
		pctx, cancel := context.WithTimeout(context.Background(), time.Second)
		cl.PollFetches(pctx).EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == correlator.HeaderError && len(h.Value) > 0 {
					got++
				}
			}
		})
		cancel()
	}
	if got != wantDead {
		t.Errorf("%d copies with hipq-error on the dead-letter topic, want %d", got, wantDead)
	}
}

// On assignment the consumer seeks to the offsets stored in PostgreSQL,
// not the group's: records already applied (by an instance whose Kafka
// commit never happened) are not applied again.
func TestIntakeSeeksToStoredOffsets(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	cfg := e.config(e2eConfig)
	topic := e.kafka.Topic("jobs")
	var rs []*kgo.Record
	for i := range 10 {
		rs = append(rs, &kgo.Record{Topic: topic, Partition: 0, Value: []byte(jobReq(fmt.Sprintf("k%d", i)))})
	}
	cl := e.kafka.Client(kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err := cl.ProduceSync(context.Background(), rs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	// Another instance applied the first 6 records and died before its
	// Kafka commit: PostgreSQL says partition 0 resumes at 6.
	a0 := e.start(cfg, "sweeper")
	if _, err := a0.st.Pool().Exec(context.Background(), `INSERT INTO hipq_offset VALUES ($1, $2, 0, 6)`, cfg.Intake.Group, topic); err != nil {
		t.Fatal(err)
	}
	a := e.start(cfg, "intake")
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		n := e.countJobs(a, "true")
		return n == 4, fmt.Sprintf("%d jobs", n)
	}, "records after the stored offset applied")
	if n := e.countJobs(a, "job_key IN ('k0','k5')"); n != 0 {
		t.Fatalf("records before the stored offset were applied again")
	}
}

// A reply that arrives before its job is dispatched is kept and applied to
// the job's first attempt once it is claimed and sent (SPEC §6, early).
func TestEarlyReplyAppliedAfterDispatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	cfg := e.config(e2eConfig)
	a := e.start(cfg, "responses", "sweeper")
	e.kafka.Produce(&kgo.Record{Topic: e.kafka.Topic("replies"), Value: []byte(`{"status":"succeeded","v":42}`),
		Headers: []kgo.RecordHeader{{Key: "hipq-job-type", Value: []byte("e2e")}, {Key: "hipq-job-key", Value: []byte("eager")}}})
	testutil.Eventually(t, 15*time.Second, func() (bool, string) {
		var n int
		_ = a.st.Pool().QueryRow(context.Background(), "SELECT count(*) FROM hipq_early_reply").Scan(&n)
		return n == 1, fmt.Sprintf("%d early replies", n)
	}, "early reply kept")
	b := e.start(cfg, "intake", "dispatcher") // no responder: only the early reply can finish it
	e.produce("jobs", jobReq("eager"))
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		j, err := b.st.JobGet(context.Background(), "e2e", "eager")
		if err != nil {
			return false, err.Error()
		}
		return j.Outcome == correlator.OutcomeSucceeded && string(j.Result) == `{"v": 42, "status": "succeeded"}`, fmt.Sprintf("%s %s %s", j.State, j.Outcome, j.Result)
	}, "job finalized by its early reply")
	// Counted once as early when read, once as applied when used (by b's
	// dispatcher after the send, or a's sweeper).
	kept, _ := a.metrics.Value("hipq_replies_total", map[string]string{"source": "kafka", "result": "early"})
	usedA, _ := a.metrics.Value("hipq_replies_total", map[string]string{"source": "early", "result": "applied"})
	usedB, _ := b.metrics.Value("hipq_replies_total", map[string]string{"source": "early", "result": "applied"})
	if kept != 1 || usedA+usedB != 1 {
		t.Fatalf("replies: %v kept early, %v+%v applied later; want 1 and 1", kept, usedA, usedB)
	}
}

// A record that passes validation but that PostgreSQL refuses (here a JSON
// lone surrogate, which jsonb cannot store) makes the batch fail; hipq
// splits it, dead-letters that record with PostgreSQL's reason, and stores
// the rest: the partition never stalls.
func TestPoisonRecordIsSplitOut(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	a := e.start(e.config(e2eConfig), "intake")
	topic := e.kafka.Topic("jobs")
	var rs []*kgo.Record
	for i := range 9 {
		v := jobReq(fmt.Sprintf("fine-%d", i))
		if i == 4 {
			v = `{"job_type":"e2e","job_key":"poison","job_data":"\ud800"}`
		}
		rs = append(rs, &kgo.Record{Topic: topic, Partition: 0, Value: []byte(v)})
	}
	cl := e.kafka.Client(kgo.RecordPartitioner(kgo.ManualPartitioner()))
	defer cl.Close()
	if err := cl.ProduceSync(context.Background(), rs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		n := e.countJobs(a, "true")
		return n == 8, fmt.Sprintf("%d jobs", n)
	}, "good records stored around the poison")
	var reason string
	if err := a.st.Pool().QueryRow(context.Background(), "SELECT reason FROM hipq_dead_letter WHERE kafka_offset = 4").Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(reason, correlator.CodeRejected+": PostgreSQL refused it") {
		t.Fatalf("reason %q", reason)
	}
}

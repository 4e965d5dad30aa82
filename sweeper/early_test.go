package sweeper_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/deadletter"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
	"github.com/hipq/hipq/sweeper"
)

var alo = map[string]*correlator.JobType{"alo": {Name: "alo", Queue: "default", Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}

var typeInfo = correlator.Types(alo)

func count(t *testing.T, st *store.Store, q string) int {
	t.Helper()
	var n int
	if err := st.Pool().QueryRow(ctx, q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func earlyReply(key string, jobID *int64) store.ReplyIn {
	r := &correlator.Reply{JobType: "alo", JobKey: key, JobID: jobID, Success: true, Retryable: true, Result: json.RawMessage(`{}`)}
	if jobID != nil {
		r.JobType, r.JobKey = "", ""
	}
	return store.ReplyIn{Reply: r, Kind: store.SourceReply, Source: store.Source{Topic: "replies", Value: []byte(`{}`),
		Headers: []correlator.Header{{Key: "Authorization", Value: []byte("Bearer s3cret")}, {Key: "trace", Value: []byte("t1")}}}}
}

// Issue 9.7 and 9.8: a sweep works off every kept early reply, not only the
// oldest batch: those past their TTL are dead-lettered, in batches, and
// copied to the responses dead-letter topic (without credentials), and
// newer ones are looked at in the same sweep.
func TestSweepPagesThroughEveryEarlyReply(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	k := kafkatest.New(t)
	dlq := k.Topic("replies.dlq")
	k.CreateTopics(1, dlq)
	cl := k.Client()
	defer cl.Close()
	const n = 2500
	var ins []store.ReplyIn
	for i := range n {
		ins = append(ins, earlyReply("k"+strconv.Itoa(i), nil))
	}
	if _, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: ins, EarlyTTL: time.Minute}, typeInfo); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_early_reply SET expires_at = now() - interval '1s'`); err != nil {
		t.Fatal(err)
	}
	sw := sweeper.New(zaptest.NewLogger(t), st, sweeper.Config{Types: alo, BatchSize: 1000,
		DeadLetters: &deadletter.Copier{Client: cl, Topic: dlq}})
	start := time.Now()
	rep, err := sw.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d early replies dead-lettered in %v (%.0f rows/s)", rep.EarlyDeadLettered, time.Since(start), float64(rep.EarlyDeadLettered)/time.Since(start).Seconds())
	if rep.EarlyDeadLettered != n || count(t, st, `SELECT count(*) FROM hipq_early_reply`) != 0 {
		t.Fatalf("one sweep dead-lettered %d of %d early replies", rep.EarlyDeadLettered, n)
	}
	if err := cl.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	rd := k.Client(kgo.ConsumeTopics(dlq), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer rd.Close()
	got := 0
	pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for got < n && pctx.Err() == nil {
		rd.PollFetches(pctx).EachRecord(func(r *kgo.Record) {
			got++
			hs := map[string]string{}
			for _, h := range r.Headers {
				hs[h.Key] = string(h.Value)
			}
			if _, ok := hs["Authorization"]; ok || hs["trace"] != "t1" || hs[correlator.HeaderError] == "" {
				t.Fatalf("copy headers %v: want trace and hipq-error, no Authorization", hs)
			}
		})
	}
	if got != n {
		t.Fatalf("%d copies on the dead-letter topic, want %d", got, n)
	}
}

// Issue 9.7: a reply kept early that names its job only by id is applied
// once that job's request is sent, like one that names type and key.
func TestEarlyReplyByJobIDAppliedAfterSend(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	if _, err := st.JobsInsert(ctx, []*correlator.Job{{Queue: "default", JobType: "alo", JobKey: "by-id", JobData: json.RawMessage(`{}`),
		MaxAttempts: 1, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)}}); err != nil {
		t.Fatal(err)
	}
	j, err := st.JobGet(ctx, "alo", "by-id")
	if err != nil {
		t.Fatal(err)
	}
	res, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{earlyReply("", &j.ID)}, EarlyTTL: time.Minute}, typeInfo)
	if err != nil || res.Verdicts[0] != correlator.Early {
		t.Fatalf("reply by id to an initial job: %v %v, want early", res.Verdicts, err)
	}
	claim, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 1, Instance: "i"})
	if err != nil || len(claim.Jobs) != 1 {
		t.Fatal(err)
	}
	c := claim.Jobs[0]
	rec, err := st.DeliveryRecord(ctx, store.Delivery{Sent: []store.AttemptRef{c.Ref()}}, typeInfo)
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Early.Applied) != 1 {
		t.Fatalf("early replies after the send: %v, want the one by id applied", rec.Early.Counts())
	}
	if j, _ := st.JobGet(ctx, "alo", "by-id"); j.State != correlator.StateFinal || j.Outcome != correlator.OutcomeSucceeded {
		t.Fatalf("job %s %s", j.State, j.Outcome)
	}
}

// Issue 9.5: the sweeper's deadlines are PostgreSQL's: a claim is rescued
// once dispatched_at (stamped by PostgreSQL) is older, by PostgreSQL's
// clock, than its type's send timeout plus grace; final jobs are pruned
// once update_time is older than the retention. The sweeper reads no
// other clock, so a host clock 60 s off either way changes nothing.
func TestSweeperDeadlinesOnTheDatabaseClock(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var jobs []*correlator.Job
	for _, k := range []string{"due", "not-yet", "http-due", "http-not-yet"} {
		typ := "alo"
		if strings.HasPrefix(k, "http") {
			typ = "web"
		}
		jobs = append(jobs, &correlator.Job{Queue: "default", JobType: typ, JobKey: k, JobData: json.RawMessage(`{}`), MaxAttempts: 1,
			Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Hour)})
	}
	if _, err := st.JobsInsert(ctx, jobs); err != nil {
		t.Fatal(err)
	}
	if _, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 10, Instance: "gone"}); err != nil {
		t.Fatal(err)
	}
	// Kafka types: 30s send timeout; "web": 5s. Grace 10s.
	for key, ago := range map[string]int{"due": 45, "not-yet": 35, "http-due": 20, "http-not-yet": 10} {
		// (a running job's started_at is its attempt's dispatched_at)
		if _, err := st.Pool().Exec(ctx, fmt.Sprintf(`WITH j AS (
			  UPDATE hipq_job SET started_at = now() - interval '%[1]d seconds' WHERE job_key = '%[2]s' RETURNING id)
			UPDATE hipq_attempt a SET dispatched_at = now() - interval '%[1]d seconds' FROM j WHERE j.id = a.job_id`, ago, key)); err != nil {
			t.Fatal(err)
		}
	}
	types := map[string]*correlator.JobType{"alo": alo["alo"], "web": {Name: "web", Queue: "default", Retry: correlator.NoRetry, SendTimeout: 5 * time.Second}}
	sw := sweeper.New(zaptest.NewLogger(t), st, sweeper.Config{Types: types, Grace: 10 * time.Second, Retention: time.Hour})
	if _, err := st.Pool().Exec(ctx, `INSERT INTO hipq_job (queue, job_type, job_key, state, outcome, update_time)
		VALUES ('default', 'alo', 'old', 'final', 'succeeded', now() - interval '61 minutes'),
		       ('default', 'alo', 'recent', 'final', 'succeeded', now() - interval '59 minutes')`); err != nil {
		t.Fatal(err)
	}
	rep, err := sw.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Rescued != 2 || rep.Pruned != 1 {
		t.Fatalf("report %+v, want 2 rescued (due, http-due) and 1 pruned (old)", rep)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_job WHERE job_key IN ('due', 'http-due') AND state = 'initial'`); n != 2 {
		t.Fatalf("%d of the 2 overdue claims undone", n)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_job WHERE job_key IN ('old', 'recent')`); n != 1 {
		t.Fatalf("%d of old/recent left, want recent only", n)
	}
}

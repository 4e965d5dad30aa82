package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
)

func randomLetters(n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('a' + rand.IntN(26))
	}
	return string(b)
}

// produceTo writes records to explicit partitions of topic.
func (e *env) produceTo(recs ...*kgo.Record) {
	e.t.Helper()
	cl := e.kafka.Client(kgo.RecordPartitioner(kgo.ManualPartitioner()))
	defer cl.Close()
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) scalar(a *app, q string) int {
	e.t.Helper()
	var n int
	if err := a.st.Pool().QueryRow(context.Background(), q).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// Issue 9.1: a 20 KB job_key is refused at decode (a dead letter naming
// the field and the limit) and the records after it, on its partition and
// the other, become jobs. And deeper: an error class nobody listed
// (here a trigger raising SQLSTATE 54000, "program limit exceeded", on one
// record) dead-letters that record instead of stalling its partition.
func TestUnlistedErrorsNeverStallAPartition(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	cfg := e.config(strings.Replace(e2eConfig, "max_bytes: 2048", "max_bytes: 65536", 1))
	a := e.start(cfg, "intake")
	if _, err := a.st.Pool().Exec(context.Background(), `
		CREATE FUNCTION refuse_unlisted() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF NEW.job_key = 'unlisted' THEN RAISE EXCEPTION 'a limit nobody listed' USING ERRCODE = '54000'; END IF;
		  RETURN NEW;
		END $$;
		CREATE TRIGGER refuse_unlisted BEFORE INSERT ON hipq_job FOR EACH ROW EXECUTE FUNCTION refuse_unlisted();`); err != nil {
		t.Fatal(err)
	}
	topic := e.kafka.Topic("jobs")
	long := randomLetters(20 << 10)
	e.produceTo(
		&kgo.Record{Topic: topic, Partition: 0, Value: []byte(jobReq("p0-before"))},
		&kgo.Record{Topic: topic, Partition: 0, Value: []byte(`{"job_type":"e2e","job_key":"` + long + `"}`)},
		&kgo.Record{Topic: topic, Partition: 0, Value: []byte(jobReq("unlisted"))},
		&kgo.Record{Topic: topic, Partition: 0, Value: []byte(jobReq("p0-after"))},
		&kgo.Record{Topic: topic, Partition: 1, Value: []byte(jobReq("p1-after"))},
	)
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		n := e.countJobs(a, "job_key IN ('p0-before', 'p0-after', 'p1-after')")
		return n == 3, fmt.Sprintf("%d of 3 jobs", n)
	}, "the records around the refused ones stored")
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		n := e.scalar(a, `SELECT count(*) FROM hipq_dead_letter WHERE
			(reason LIKE 'too_large: job_key: 20480 bytes is more than the limit of 1024%' AND kafka_offset = 1) OR
			(reason LIKE 'rejected: PostgreSQL refused it: %a limit nobody listed%' AND kafka_offset = 2)`)
		return n == 2, fmt.Sprintf("%d of 2", n)
	}, "both refused records dead-lettered")
}

// Issue 9.2: a record dead-lettered with a header whose name holds a NUL
// byte or invalid UTF-8 is kept with its headers byte for byte, and the
// records after it, on its partition and the other, are applied: on the
// intake topic and on the response topic.
func TestHeadersPostgreSQLCannotStoreAsText(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	a := e.start(e.config(e2eConfig), "intake", "responses")
	bad := []kgo.RecordHeader{{Key: "x\x00y", Value: []byte("v\x00")}, {Key: "bad\xffname", Value: []byte{0xff}}, {Key: "ok", Value: []byte("fine")}}
	jobs, replies := e.kafka.Topic("jobs"), e.kafka.Topic("replies")
	e.produceTo(
		&kgo.Record{Topic: jobs, Partition: 0, Value: []byte(`not json`), Headers: bad},
		&kgo.Record{Topic: jobs, Partition: 0, Value: []byte(jobReq("after-0"))},
		&kgo.Record{Topic: jobs, Partition: 1, Value: []byte(jobReq("after-1"))},
		&kgo.Record{Topic: replies, Partition: 0, Value: []byte(`{"status":"ok"}`), Headers: append([]kgo.RecordHeader{
			{Key: "hipq-job-type", Value: []byte("nope")}, {Key: "hipq-job-key", Value: []byte("k")}}, bad...)},
		&kgo.Record{Topic: replies, Partition: 0, Value: []byte(`{"status":"ok"}`), Headers: []kgo.RecordHeader{
			{Key: "hipq-job-type", Value: []byte("nope")}, {Key: "hipq-job-key", Value: []byte("after-0")}}},
		&kgo.Record{Topic: replies, Partition: 1, Value: []byte(`{"status":"ok"}`), Headers: []kgo.RecordHeader{
			{Key: "hipq-job-type", Value: []byte("nope")}, {Key: "hipq-job-key", Value: []byte("after-1")}}},
	)
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		j := e.countJobs(a, "job_key IN ('after-0', 'after-1')")
		r := e.scalar(a, `SELECT count(*) FROM hipq_dead_letter WHERE source = 'reply'`)
		return j == 2 && r == 3, fmt.Sprintf("%d of 2 jobs, %d of 3 reply dead letters", j, r)
	}, "the records after the bad ones applied")
	for _, src := range []string{"intake", "reply"} {
		var id int64
		if err := a.st.Pool().QueryRow(context.Background(), `SELECT id FROM hipq_dead_letter WHERE source = $1 AND kafka_offset = 0
			AND kafka_partition = 0`, src).Scan(&id); err != nil {
			t.Fatalf("%s: %v", src, err)
		}
		d, err := a.st.DeadLetterGet(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]string{}
		for _, h := range d.Source.Headers {
			got[h.Key] = string(h.Value)
		}
		for _, h := range bad {
			if v, ok := got[h.Key]; !ok || v != string(h.Value) {
				t.Errorf("%s dead letter: header %q = %q, want %q (kept: %q)", src, h.Key, v, h.Value, got)
			}
		}
	}
}

// Issue 9.13: records of aborted transactions are never read: an aborted
// intake record makes no job, an aborted reply resolves none; the
// committed records after them apply.
func TestAbortedTransactionsAreNotRead(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	if e.kafka.Fake() == nil && !strings.Contains(e.kafka.Brokers[0], ":") {
		t.Skip("needs a cluster with transactions")
	}
	a := e.start(e.config(e2eConfig), "intake", "responses")
	tx := e.kafka.Client(kgo.TransactionalID(fmt.Sprintf("hipq-test-%d", rand.Int64())), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	defer tx.Close()
	ctx := context.Background()
	// A job to reply to, applied first.
	e.produce("jobs", jobReq("target"))
	testutil.Eventually(t, 20*time.Second, func() (bool, string) { return e.countJobs(a, "job_key = 'target'") == 1, "" }, "the target job")
	send := func(commit bool, recs ...*kgo.Record) {
		if err := tx.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		if err := tx.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if err := tx.EndTransaction(ctx, kgo.TransactionEndTry(commit)); err != nil {
			t.Fatal(err)
		}
	}
	jobs, replies := e.kafka.Topic("jobs"), e.kafka.Topic("replies")
	// The target job is initial: a reply for it with attempt 1 would be
	// kept as early (and dead-lettered by key with no job) if read.
	reply := func(key string) *kgo.Record {
		return &kgo.Record{Topic: replies, Partition: 0, Value: []byte(`{"status":"ok"}`), Headers: []kgo.RecordHeader{
			{Key: "hipq-job-type", Value: []byte("e2e")}, {Key: "hipq-job-key", Value: []byte(key)}}}
	}
	send(false, &kgo.Record{Topic: jobs, Partition: 0, Value: []byte(jobReq("aborted"))}, reply("aborted-reply"))
	send(true, &kgo.Record{Topic: jobs, Partition: 0, Value: []byte(jobReq("committed"))}, reply("committed-reply"))
	testutil.Eventually(t, 20*time.Second, func() (bool, string) {
		j := e.countJobs(a, "job_key = 'committed'")
		r := e.scalar(a, `SELECT count(*) FROM hipq_early_reply WHERE job_key = 'committed-reply'`)
		return j == 1 && r == 1, fmt.Sprintf("job %d, early reply %d", j, r)
	}, "the committed records applied")
	if n := e.countJobs(a, "job_key = 'aborted'"); n != 0 {
		t.Fatalf("an aborted intake record became a job")
	}
	if n := e.scalar(a, `SELECT count(*) FROM hipq_early_reply WHERE job_key = 'aborted-reply'`); n != 0 {
		t.Fatalf("an aborted reply was read")
	}
}

// Issue 9.14: with a session timeout of 3s the members heartbeat often
// enough to stay in the group: one assignment, no rebalance after it.
func TestShortSessionTimeoutKeepsTheGroup(t *testing.T) {
	t.Parallel()
	// Kafka's brokers allow sessions from 6s by default; this one from 1s.
	e := newEnvWith(t, kafkatest.New(t, kfake.GroupMinSessionTimeout(time.Second)), e2eTopics...)
	cfg := e.config(strings.Replace(e2eConfig, "session_timeout: 6s", "session_timeout: 3s", 1))
	core, logs := observer.New(zap.InfoLevel)
	a, err := newApp(context.Background(), cfg, zap.New(core), appOptions{roles: []string{"intake"}, metadataMinAge: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.run(ctx) }()
	defer func() { cancel(); _ = <-done; a.close() }()
	e.produce("jobs", jobReq("first"))
	testutil.Eventually(t, 20*time.Second, func() (bool, string) { return e.countJobs(a, "job_key = 'first'") == 1, "" }, "the first job")
	// Three session timeouts: a member heartbeating every 3s would have
	// been dropped and rejoined by now.
	time.Sleep(10 * time.Second)
	e.produce("jobs", jobReq("second"))
	testutil.Eventually(t, 20*time.Second, func() (bool, string) { return e.countJobs(a, "job_key = 'second'") == 1, "" }, "the second job")
	if n := logs.FilterMessage("partitions assigned").Len(); n != 1 {
		t.Fatalf("%d assignments, want 1: the member was dropped from the group", n)
	}
}

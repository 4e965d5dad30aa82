package consumer

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// A record batch that decompresses to more than the group may hold (a
// few hundred bytes of zstd on the wire holding 2 MiB, against a bound of
// 1 MiB) is never read whole: franz-go stops the partition there, and the
// group dead-letters the batch's offsets too_large and reads on after it,
// the stored offset moved past it in the dead letter's transaction. The
// records around it become jobs; the partition is not blocked: after a
// record, as a new group's first batch (no offset stored yet), and after
// a transaction's commit marker (an offset between the stored one and
// the batch that holds no record).
func TestBatchTooLargeToDecompressIsDeadLettered(t *testing.T) {
	t.Parallel()
	bomb := `{"job_type":"t","job_key":"bomb","payload":"` + strings.Repeat("0", 2<<20) + `"}`
	job := func(key string) string { return `{"job_type":"t","job_key":"` + key + `"}` }
	for _, c := range []struct {
		name          string
		transactional bool     // the first value produced in a committed transaction
		values        []string // one batch each
		keys          []string // the jobs made
		at, next      int64    // the dead letter's offset; the stored next offset
	}{
		{name: "after a record", values: []string{job("before"), bomb, job("after")}, keys: []string{"before", "after"}, at: 1, next: 3},
		{name: "first", values: []string{bomb, job("after")}, keys: []string{"after"}, at: 0, next: 2},
		{name: "after a commit marker", transactional: true, values: []string{job("before"), bomb, job("after")},
			keys: []string{"before", "after"}, at: 2, next: 4},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			st := pgtest.New(t)
			k := kafkatest.New(t)
			in := k.Topic("jobs")
			k.CreateTopics(1, in)
			types := correlator.Types{"t": {Name: "t", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}
			const bound = 1 << 20
			group := in + "-g"
			intake, err := NewIntake(zaptest.NewLogger(t), st, IntakeConfig{GroupConfig: GroupConfig{Kafka: kafkaconn.Config{Brokers: k.Brokers},
				Group: group, Topics: []string{in}, MaxDecompressBatchBytes: bound}, MaxBytes: 4096, Types: types})
			if err != nil {
				t.Fatal(err)
			}
			for i, v := range c.values {
				opts := []kgo.Opt{kgo.ProducerBatchCompression(kgo.ZstdCompression()), kgo.ProducerBatchMaxBytes(8 << 20)}
				tx := c.transactional && i == 0
				if tx {
					opts = append(opts, kgo.TransactionalID(in+"-tx"))
				}
				prod := k.Client(opts...)
				if tx {
					if err := prod.BeginTransaction(); err != nil {
						t.Fatal(err)
					}
				}
				if err := prod.ProduceSync(ctx, &kgo.Record{Topic: in, Value: []byte(v)}).FirstErr(); err != nil {
					t.Fatal(err)
				}
				if tx {
					if err := prod.EndTransaction(ctx, kgo.TryCommit); err != nil {
						t.Fatal(err)
					}
				}
				prod.Close()
			}
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); _ = intake.Run(runCtx) }()
			defer func() { stop(); <-done }()
			testutil.Eventually(t, time.Minute, func() bool {
				var n int
				err := st.Pool().QueryRow(ctx, `SELECT (SELECT count(*) FROM hipq_job) + (SELECT count(*) FROM hipq_dead_letter)`).Scan(&n)
				return err == nil && n == len(c.keys)+1
			}, "the records around the batch stored, and the batch dead-lettered")
			for _, key := range c.keys {
				if _, err := st.JobGet(ctx, "t", key); err != nil {
					t.Errorf("job %s: %v", key, err)
				}
			}
			if _, err := st.JobGet(ctx, "t", "bomb"); err != correlator.ErrNotFound {
				t.Errorf("a job of the batch never read: %v", err)
			}
			var (
				topic, reason string
				offset        int64
				valueNull     bool
			)
			if err := st.Pool().QueryRow(ctx, `SELECT topic, kafka_offset, reason, record_value IS NULL FROM hipq_dead_letter`).
				Scan(&topic, &offset, &reason, &valueNull); err != nil {
				t.Fatal(err)
			}
			want := fmt.Sprintf("%s: the record batch at offsets %d to %d decompresses to more than %d bytes", correlator.CodeTooLarge, c.at, c.at, bound)
			if topic != in || offset != c.at || !strings.HasPrefix(reason, want) || !valueNull {
				t.Errorf("dead letter %s@%d %q (value null: %v), want %s@%d %q…", topic, offset, reason, valueNull, in, c.at, want)
			}
			testutil.Eventually(t, time.Minute, func() bool {
				next, err := st.OffsetsLoad(ctx, group, []store.TopicPartition{{Topic: in, Partition: 0}})
				return err == nil && next[store.TopicPartition{Topic: in, Partition: 0}] == c.next
			}, "the stored next offset at %d", c.next)
		})
	}
}

// A batch whose dead letter cannot be written (PostgreSQL refuses it) is
// tried again, longer each time, its partition unread meanwhile and
// reported as stalled after StallAfter: once the write goes through, the
// batch is dead-lettered, the partition read on and the stall over.
func TestBatchTooLargeIsTriedAgainAfterAFailedWrite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st := pgtest.New(t)
	k := kafkatest.New(t)
	in := k.Topic("jobs")
	k.CreateTopics(1, in)
	for _, q := range []string{
		`CREATE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$`,
		`CREATE TRIGGER test_refuse BEFORE INSERT ON hipq_dead_letter FOR EACH ROW EXECUTE FUNCTION test_refuse()`,
	} {
		if _, err := st.Pool().Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	types := correlator.Types{"t": {Name: "t", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}
	intake, err := NewIntake(zaptest.NewLogger(t), st, IntakeConfig{GroupConfig: GroupConfig{Kafka: kafkaconn.Config{Brokers: k.Brokers},
		Group: in + "-g", Topics: []string{in}, MaxDecompressBatchBytes: 1 << 20, StallAfter: time.Millisecond}, MaxBytes: 4096, Types: types})
	if err != nil {
		t.Fatal(err)
	}
	prod := k.Client(kgo.ProducerBatchCompression(kgo.ZstdCompression()), kgo.ProducerBatchMaxBytes(8<<20))
	defer prod.Close()
	bomb := `{"job_type":"t","job_key":"bomb","payload":"` + strings.Repeat("0", 2<<20) + `"}`
	for _, v := range []string{bomb, `{"job_type":"t","job_key":"after"}`} {
		if err := prod.ProduceSync(ctx, &kgo.Record{Topic: in, Value: []byte(v)}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = intake.Run(runCtx) }()
	defer func() { stop(); <-done }()
	g := intake.g
	testutil.Eventually(t, time.Minute, func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		s := g.skips[store.TopicPartition{Topic: in, Partition: 0}]
		return s != nil && s.tries >= 2
	}, "the batch's dead letter refused twice, and waiting to be tried again")
	if err := intake.Stalled(); err == nil || !strings.Contains(err.Error(), "a batch too large to read") {
		t.Errorf("stalled: %v, want the partition reported waiting on the batch", err)
	}
	var n int
	if err := st.Pool().QueryRow(ctx, `SELECT count(*) FROM hipq_job`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d jobs while the batch before them waits (%v), want none", n, err)
	}
	if _, err := st.Pool().Exec(ctx, `DROP TRIGGER test_refuse ON hipq_dead_letter`); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() bool {
		_, err := st.JobGet(ctx, "t", "after")
		var dls int
		_ = st.Pool().QueryRow(ctx, `SELECT count(*) FROM hipq_dead_letter WHERE kafka_offset = 0`).Scan(&dls)
		return err == nil && dls == 1
	}, "the batch dead-lettered once the write goes through, and the record after it stored")
	if err := intake.Stalled(); err != nil {
		t.Errorf("still stalled once the batch was dead-lettered: %v", err)
	}
}

// Another consumer may dead-letter the batch first (a rebalance while
// this one's write was failing): this one's write then loses the offset
// compare-and-set, and it reads on from the offset stored, past the
// batch, writing no second dead letter. The batch is the partition's
// first record and nothing was stored when the group took it, so the
// client has no position of the partition to move until hipq gives it
// one: the seek past the batch must still take effect.
func TestBatchTooLargePassedByAnotherConsumer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st := pgtest.New(t)
	k := kafkatest.New(t)
	in := k.Topic("jobs")
	k.CreateTopics(1, in)
	group := in + "-g"
	for _, q := range []string{
		`CREATE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$`,
		`CREATE TRIGGER test_refuse BEFORE INSERT ON hipq_dead_letter FOR EACH ROW EXECUTE FUNCTION test_refuse()`,
	} {
		if _, err := st.Pool().Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	types := correlator.Types{"t": {Name: "t", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}
	intake, err := NewIntake(zaptest.NewLogger(t), st, IntakeConfig{GroupConfig: GroupConfig{Kafka: kafkaconn.Config{Brokers: k.Brokers},
		Group: group, Topics: []string{in}, MaxDecompressBatchBytes: 1 << 20}, MaxBytes: 4096, Types: types})
	if err != nil {
		t.Fatal(err)
	}
	prod := k.Client(kgo.ProducerBatchCompression(kgo.ZstdCompression()), kgo.ProducerBatchMaxBytes(8<<20))
	defer prod.Close()
	bomb := `{"job_type":"t","job_key":"bomb","payload":"` + strings.Repeat("0", 2<<20) + `"}`
	for _, v := range []string{bomb, `{"job_type":"t","job_key":"after"}`} {
		if err := prod.ProduceSync(ctx, &kgo.Record{Topic: in, Value: []byte(v)}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = intake.Run(runCtx) }()
	defer func() { stop(); <-done }()
	g := intake.g
	testutil.Eventually(t, time.Minute, func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		s := g.skips[store.TopicPartition{Topic: in, Partition: 0}]
		return s != nil && s.tries >= 1
	}, "the batch's dead letter refused once")
	// (What the other consumer committed: the offset past the batch.)
	if _, err := st.Pool().Exec(ctx, `INSERT INTO hipq_offset (consumer_group, topic, kafka_partition, next_offset) VALUES ($1, $2, 0, 1)`,
		group, in); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, `DROP TRIGGER test_refuse ON hipq_dead_letter`); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, func() bool {
		_, err := st.JobGet(ctx, "t", "after")
		return err == nil
	}, "the record after the batch stored, read on from the offset the other consumer stored")
	var dls int
	if err := st.Pool().QueryRow(ctx, `SELECT count(*) FROM hipq_dead_letter`).Scan(&dls); err != nil || dls != 0 {
		t.Errorf("%d dead letters (%v), want none: the other consumer wrote the batch's", dls, err)
	}
}

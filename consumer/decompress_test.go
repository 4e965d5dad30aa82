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

// bomb is an intake record of 2 MiB that zstd writes in a few hundred
// bytes: past the bound of 1 MiB the tests give the group.
var bomb = `{"job_type":"t","job_key":"bomb","payload":"` + strings.Repeat("0", 2<<20) + `"}`

const bombBound = 1 << 20

// bombCase is a store, a one-partition intake topic holding values (one
// batch each, zstd; the first in a committed transaction when
// transactional), and its group, not started.
type bombCase struct {
	st     *store.Store
	in     string
	group  string
	intake *Intake
}

func newBombCase(t *testing.T, values []string, transactional, refuseDeadLetters bool, stallAfter time.Duration) *bombCase {
	t.Helper()
	ctx := context.Background()
	c := &bombCase{st: pgtest.New(t)}
	k := kafkatest.New(t)
	c.in = k.Topic("jobs")
	c.group = c.in + "-g"
	k.CreateTopics(1, c.in)
	if refuseDeadLetters {
		for _, q := range []string{
			`CREATE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$`,
			`CREATE TRIGGER test_refuse BEFORE INSERT ON hipq_dead_letter FOR EACH ROW EXECUTE FUNCTION test_refuse()`,
		} {
			if _, err := c.st.Pool().Exec(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
	}
	types := correlator.Types{"t": {Name: "t", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}}
	var err error
	c.intake, err = NewIntake(zaptest.NewLogger(t), c.st, IntakeConfig{GroupConfig: GroupConfig{Kafka: kafkaconn.Config{Brokers: k.Brokers},
		Group: c.group, Topics: []string{c.in}, MaxDecompressBatchBytes: bombBound, StallAfter: stallAfter}, MaxBytes: 4096, Types: types})
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range values {
		opts := []kgo.Opt{kgo.ProducerBatchCompression(kgo.ZstdCompression()), kgo.ProducerBatchMaxBytes(8 << 20)}
		tx := transactional && i == 0
		if tx {
			opts = append(opts, kgo.TransactionalID(c.in+"-tx"))
		}
		prod := k.Client(opts...)
		if tx {
			if err := prod.BeginTransaction(); err != nil {
				t.Fatal(err)
			}
		}
		if err := prod.ProduceSync(ctx, &kgo.Record{Topic: c.in, Value: []byte(v)}).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if tx {
			if err := prod.EndTransaction(ctx, kgo.TryCommit); err != nil {
				t.Fatal(err)
			}
		}
		prod.Close()
	}
	return c
}

// run runs the group until the test ends.
func (c *bombCase) run(t *testing.T) {
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.intake.Run(ctx) }()
	t.Cleanup(func() { stop(); <-done })
}

// skipTries is how many writes of the partition's pending skip failed
// (-1: none pending).
func (c *bombCase) skipTries() int {
	g := c.intake.g
	g.mu.Lock()
	defer g.mu.Unlock()
	if s := g.skips[store.TopicPartition{Topic: c.in, Partition: 0}]; s != nil {
		return s.tries
	}
	return -1
}

func (c *bombCase) exec(t *testing.T, q string, args ...any) {
	t.Helper()
	if _, err := c.st.Pool().Exec(context.Background(), q, args...); err != nil {
		t.Fatal(err)
	}
}

func (c *bombCase) count(q string) int {
	var n int
	if err := c.st.Pool().QueryRow(context.Background(), q).Scan(&n); err != nil {
		return -1
	}
	return n
}

// A record batch that decompresses to more than the group may hold is
// never read whole: franz-go stops the partition there, and the group
// dead-letters the batch's offsets too_large and reads on after it, the
// stored offset moved past it in the dead letter's transaction. The
// records around it become jobs; the partition is not blocked: after a
// record, as a new group's first batch (no offset stored yet), and after
// a transaction's commit marker (an offset between the stored one and
// the batch that holds no record).
func TestBatchTooLargeToDecompressIsDeadLettered(t *testing.T) {
	t.Parallel()
	job := func(key string) string { return `{"job_type":"t","job_key":"` + key + `"}` }
	for _, tc := range []struct {
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
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			c := newBombCase(t, tc.values, tc.transactional, false, 0)
			c.run(t)
			testutil.Eventually(t, time.Minute, func() bool {
				return c.count(`SELECT (SELECT count(*) FROM hipq_job) + (SELECT count(*) FROM hipq_dead_letter)`) == len(tc.keys)+1
			}, "the records around the batch stored, and the batch dead-lettered")
			for _, key := range tc.keys {
				if _, err := c.st.JobGet(ctx, "t", key); err != nil {
					t.Errorf("job %s: %v", key, err)
				}
			}
			if _, err := c.st.JobGet(ctx, "t", "bomb"); err != correlator.ErrNotFound {
				t.Errorf("a job of the batch never read: %v", err)
			}
			var (
				topic, reason string
				offset        int64
				valueNull     bool
			)
			if err := c.st.Pool().QueryRow(ctx, `SELECT topic, kafka_offset, reason, record_value IS NULL FROM hipq_dead_letter`).
				Scan(&topic, &offset, &reason, &valueNull); err != nil {
				t.Fatal(err)
			}
			want := fmt.Sprintf("%s: the record batch at offsets %d to %d decompresses to more than %d bytes", correlator.CodeTooLarge, tc.at, tc.at, bombBound)
			if topic != c.in || offset != tc.at || !strings.HasPrefix(reason, want) || !valueNull {
				t.Errorf("dead letter %s@%d %q (value null: %v), want %s@%d %q…", topic, offset, reason, valueNull, c.in, tc.at, want)
			}
			testutil.Eventually(t, time.Minute, func() bool {
				next, err := c.st.OffsetsLoad(ctx, c.group, []store.TopicPartition{{Topic: c.in, Partition: 0}})
				return err == nil && next[store.TopicPartition{Topic: c.in, Partition: 0}] == tc.next
			}, "the stored next offset at %d", tc.next)
		})
	}
}

// A batch whose dead letter cannot be written (PostgreSQL refuses it) is
// tried again, longer each time, its partition unread meanwhile and
// reported as stalled after StallAfter: once the write goes through, the
// batch is dead-lettered, the partition read on and the stall over.
func TestBatchTooLargeIsTriedAgainAfterAFailedWrite(t *testing.T) {
	t.Parallel()
	c := newBombCase(t, []string{bomb, `{"job_type":"t","job_key":"after"}`}, false, true, time.Millisecond)
	c.run(t)
	testutil.Eventually(t, time.Minute, func() bool { return c.skipTries() >= 2 },
		"the batch's dead letter refused twice, and waiting to be tried again")
	if err := c.intake.Stalled(); err == nil || !strings.Contains(err.Error(), "a batch too large to read") {
		t.Errorf("stalled: %v, want the partition reported waiting on the batch", err)
	}
	if n := c.count(`SELECT count(*) FROM hipq_job`); n != 0 {
		t.Fatalf("%d jobs while the batch before them waits, want none", n)
	}
	c.exec(t, `DROP TRIGGER test_refuse ON hipq_dead_letter`)
	testutil.Eventually(t, time.Minute, func() bool {
		_, err := c.st.JobGet(context.Background(), "t", "after")
		return err == nil && c.count(`SELECT count(*) FROM hipq_dead_letter WHERE kafka_offset = 0`) == 1
	}, "the batch dead-lettered once the write goes through, and the record after it stored")
	if err := c.intake.Stalled(); err != nil {
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
	c := newBombCase(t, []string{bomb, `{"job_type":"t","job_key":"after"}`}, false, true, 0)
	c.run(t)
	testutil.Eventually(t, time.Minute, func() bool { return c.skipTries() >= 1 }, "the batch's dead letter refused once")
	// (What the other consumer committed: the offset past the batch.)
	c.exec(t, `INSERT INTO hipq_offset (consumer_group, topic, kafka_partition, next_offset) VALUES ($1, $2, 0, 1)`, c.group, c.in)
	c.exec(t, `DROP TRIGGER test_refuse ON hipq_dead_letter`)
	testutil.Eventually(t, time.Minute, func() bool {
		_, err := c.st.JobGet(context.Background(), "t", "after")
		return err == nil
	}, "the record after the batch stored, read on from the offset the other consumer stored")
	if n := c.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
		t.Errorf("%d dead letters, want none: the other consumer wrote the batch's", n)
	}
}

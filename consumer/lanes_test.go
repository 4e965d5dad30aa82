package consumer

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// recorder records the offsets of every batch committed, in commit order,
// by the groups laneIntake wraps with it; hook runs before each batch (an
// error it returns is the batch's).
type recorder struct {
	hook func(recs []*kgo.Record) error

	mu        sync.Mutex
	committed map[int32][]int64
}

// recorded is one group's applier, recorded.
type recorded struct {
	applier
	*recorder
}

func (r recorded) apply(ctx context.Context, recs []*kgo.Record, adv []store.OffsetAdvance) (func(), error) {
	if r.hook != nil {
		if err := r.hook(recs); err != nil {
			return nil, err
		}
	}
	after, err := r.applier.apply(ctx, recs, adv)
	if err != nil {
		return after, err
	}
	type at struct {
		p int32
		o int64
	}
	read := make([]at, len(recs)) // in the order applied (the group sorts recs once committed)
	for i, rec := range recs {
		read[i] = at{rec.Partition, rec.Offset}
	}
	return func() {
		r.mu.Lock()
		for _, a := range read {
			r.committed[a.p] = append(r.committed[a.p], a.o)
		}
		r.mu.Unlock()
		if after != nil {
			after()
		}
	}, nil
}

func (r *recorder) count(p int32) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.committed[p])
}

// exactlyOnce fails unless partition p's records 0..n-1 were each
// committed once, in order.
func (r *recorder) exactlyOnce(t *testing.T, p int32, n int) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	want := make([]int64, n)
	for i := range want {
		want[i] = int64(i)
	}
	if got := r.committed[p]; !slices.Equal(got, want) {
		t.Errorf("partition %d: committed offsets %v, want 0..%d once each, in order", p, got, n-1)
	}
}

// laneIntake is an intake group over topic with its applier recorded.
func laneIntake(t *testing.T, st *store.Store, log *zap.Logger, brokers []string, topic string, concurrency, maxPoll int, rec *recorder) *Intake {
	t.Helper()
	in, err := NewIntake(log, st, IntakeConfig{GroupConfig: GroupConfig{Kafka: kafkaconn.Config{Brokers: brokers},
		Group: topic + "-g", Topics: []string{topic}, SessionTimeout: 6 * time.Second, Concurrency: concurrency, MaxPollRecords: maxPoll},
		MaxBytes: 4096, Types: correlator.Types{"t": {Name: "t", Queue: "default", Retry: correlator.NoRetry}}})
	if err != nil {
		t.Fatal(err)
	}
	in.g.app = recorded{applier: in.g.app, recorder: rec}
	return in
}

func produceJobs(t *testing.T, k *kafkatest.Cluster, topic string, partitions int32, from, n int) {
	t.Helper()
	cl := k.Client(kgo.RecordPartitioner(kgo.ManualPartitioner()))
	defer cl.Close()
	var recs []*kgo.Record
	for p := range partitions {
		for i := from; i < from+n; i++ {
			recs = append(recs, &kgo.Record{Topic: topic, Partition: p,
				Value: fmt.Appendf(nil, `{"job_type":"t","job_key":"p%d-%d","job_data":{}}`, p, i)})
		}
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// laneFixture is a store, a fake cluster and a topic of parts partitions
// holding n jobs each, and a recorder for the groups over it.
func laneFixture(t *testing.T, name string, parts int32, n int) (*store.Store, *kafkatest.Cluster, string, *recorder) {
	t.Helper()
	st := pgtest.New(t)
	k := kafkatest.New(t)
	topic := k.Topic(name)
	k.CreateTopics(parts, topic)
	if n > 0 {
		produceJobs(t, k, topic, parts, 0, n)
	}
	return st, k, topic, &recorder{committed: map[int32][]int64{}}
}

func runGroup(t *testing.T, run func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = run(ctx) }()
	return func() { cancel(); <-done }
}

// With concurrency 2, batches of two partitions are applied at once, each
// in its own transaction (with one lane, the first batch would wait here
// for a second that never comes), and each record exactly once.
func TestLanesApplyPartitionsAtOnce(t *testing.T) {
	t.Parallel()
	st, k, topic, rec := laneFixture(t, "lanes", 2, 50)

	var mu sync.Mutex
	inside, most := 0, 0
	rec.hook = func([]*kgo.Record) error {
		mu.Lock()
		inside++
		most = max(most, inside)
		mu.Unlock()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) { // until both lanes are in, once
			mu.Lock()
			both := most >= 2
			mu.Unlock()
			if both {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		mu.Lock()
		inside--
		mu.Unlock()
		return nil
	}
	in := laneIntake(t, st, zap.NewNop(), k.Brokers, topic, 2, 20, rec)
	stop := runGroup(t, in.Run)
	defer stop()
	waitFor(t, time.Minute, "both partitions applied", func() bool { return rec.count(0) == 50 && rec.count(1) == 50 })
	stop()
	mu.Lock()
	defer mu.Unlock()
	if most < 2 {
		t.Fatalf("at most %d batch was applied at once, want 2", most)
	}
	rec.exactlyOnce(t, 0, 50)
	rec.exactlyOnce(t, 1, 50)
}

// A batch PostgreSQL refuses for a passing reason is tried again in place:
// the records queued behind it in its lane wait for it (nothing skipped,
// nothing applied twice), while the other lane's partition is applied
// meanwhile.
func TestLaneTriesAFailedBatchAgainInPlace(t *testing.T) {
	t.Parallel()
	st, k, topic, rec := laneFixture(t, "retry", 2, 60)

	failures := 0
	rec.hook = func(recs []*kgo.Record) error {
		// Partition 0 fails until partition 1 is all applied.
		if recs[0].Partition == 0 && rec.count(1) < 60 {
			failures++
			return &pgconn.PgError{Code: "40001", Message: "could not serialize access (test)"}
		}
		return nil
	}
	core, logs := observer.New(zapcore.WarnLevel)
	in := laneIntake(t, st, zap.New(core), k.Brokers, topic, 2, 7, rec)
	stop := runGroup(t, in.Run)
	defer stop()
	waitFor(t, time.Minute, "both partitions applied", func() bool { return rec.count(0) == 60 && rec.count(1) == 60 })
	stop()
	if failures == 0 || logs.FilterMessage("cannot apply records; trying them again").Len() == 0 {
		t.Fatalf("partition 0 never failed (%d failures): the test proves nothing", failures)
	}
	rec.exactlyOnce(t, 0, 60)
	rec.exactlyOnce(t, 1, 60)
}

// Members joining and leaving while records stream in (partitions move
// between them with batches queued in their lanes and in flight): every
// record is applied exactly once, and none is skipped.
func TestLanesRebalanceAppliesEachRecordOnce(t *testing.T) {
	t.Parallel()
	const parts, rounds, per = 6, 30, 10
	st, k, topic, rec := laneFixture(t, "rebalance", parts, 0)
	a := laneIntake(t, st, zap.NewNop(), k.Brokers, topic, 2, 25, rec)
	stopA := runGroup(t, a.Run)
	defer stopA()
	var stopB func()
	for r := range rounds {
		produceJobs(t, k, topic, parts, r*per, per)
		switch r {
		case rounds / 3:
			b := laneIntake(t, st, zap.NewNop(), k.Brokers, topic, 2, 25, rec)
			stopB = runGroup(t, b.Run)
			defer stopB()
		case 2 * rounds / 3:
			stopA()
		}
		time.Sleep(20 * time.Millisecond) // records arrive while partitions move
	}
	waitFor(t, 2*time.Minute, "every record applied", func() bool {
		for p := range int32(parts) {
			if rec.count(p) < rounds*per {
				return false
			}
		}
		return true
	})
	stopB()
	for p := range int32(parts) {
		rec.exactlyOnce(t, p, rounds*per)
	}
	stored, err := st.OffsetsLoad(context.Background(), topic+"-g", func() []store.TopicPartition {
		var tps []store.TopicPartition
		for p := range int32(parts) {
			tps = append(tps, store.TopicPartition{Topic: topic, Partition: p})
		}
		return tps
	}())
	if err != nil {
		t.Fatal(err)
	}
	for tp, next := range stored {
		if next != rounds*per {
			t.Errorf("%v: stored next offset %d, want %d", tp, next, rounds*per)
		}
	}
	if len(stored) != parts {
		t.Errorf("offsets stored for %d partitions, want %d", len(stored), parts)
	}
}

// Stored offsets rewound under a running group (an operator reading a
// partition again, say): the batch in flight is refused by the
// compare-and-set, and what the group had read ahead of it, queued in its
// lane or waiting for room, is dropped rather than applied past the gap;
// the partition is read again from the stored offset.
func TestLanesReadAgainFromRewoundOffsets(t *testing.T) {
	t.Parallel()
	st, k, topic, rec := laneFixture(t, "rewind", 1, 60)

	release := make(chan struct{})
	var once, released sync.Once
	defer released.Do(func() { close(release) }) // a failed wait must not hold the lane
	rec.hook = func(recs []*kgo.Record) error {
		if recs[0].Offset == 10 {
			once.Do(func() { <-release }) // the second batch waits while the group reads ahead
		}
		return nil
	}
	in := laneIntake(t, st, zap.NewNop(), k.Brokers, topic, 2, 10, rec)
	stop := runGroup(t, in.Run)
	defer stop()
	g := in.g
	waitFor(t, time.Minute, "records read ahead of the held batch", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.fullLocked(0)
	})
	if _, err := st.Pool().Exec(context.Background(),
		`UPDATE hipq_offset SET next_offset = 5 WHERE consumer_group = $1 AND topic = $2 AND kafka_partition = 0`, topic+"-g", topic); err != nil {
		t.Fatal(err)
	}
	released.Do(func() { close(release) })
	waitFor(t, time.Minute, "the partition read again from offset 5", func() bool { return rec.count(0) >= 10+55 })
	stop()
	var want []int64
	for o := range int64(10) {
		want = append(want, o)
	}
	for o := int64(5); o < 60; o++ {
		want = append(want, o)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if got := rec.committed[0]; !slices.Equal(got, want) {
		t.Fatalf("committed offsets %v, want 0..9 then 5..59", got)
	}
}

// A batch split to find a poison record whose first half then meets a
// conflict (another consumer applied some of its partition): the
// conflicting partition is sought again, and the batch's other partition
// is still applied, poison record dead-lettered, none of it skipped.
func TestLaneConflictInASplitBatchKeepsTheRest(t *testing.T) {
	t.Parallel()
	st, k, topic, rec := laneFixture(t, "split", 2, 0)
	produce := func(p int32, from, n int) []*kgo.Record {
		var recs []*kgo.Record
		for i := from; i < from+n; i++ {
			recs = append(recs, &kgo.Record{Topic: topic, Partition: p,
				Value: fmt.Appendf(nil, `{"job_type":"t","job_key":"p%d-%d","job_data":{}}`, p, i)})
		}
		return recs
	}
	cl := k.Client(kgo.RecordPartitioner(kgo.ManualPartitioner()))
	defer cl.Close()
	if err := cl.ProduceSync(context.Background(), produce(0, 0, 10)...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	rec.hook = func(recs []*kgo.Record) error {
		onlyP := true
		for _, r := range recs {
			if r.Partition == 1 && r.Offset == 5 {
				return fmt.Errorf("poison record (test)") // not transient: the batch is split
			}
			onlyP = onlyP && r.Partition == 0
		}
		if onlyP && recs[0].Offset == 10 {
			once.Do(func() { // another consumer applied offsets 10 and 11 of partition 0
				if _, err := st.Pool().Exec(context.Background(), `UPDATE hipq_offset SET next_offset = 12
				  WHERE consumer_group = $1 AND topic = $2 AND kafka_partition = 0`, topic+"-g", topic); err != nil {
					t.Error(err)
				}
			})
		}
		return nil
	}
	in := laneIntake(t, st, zap.NewNop(), k.Brokers, topic, 1, 40, rec)
	stop := runGroup(t, in.Run)
	defer stop()
	waitFor(t, time.Minute, "partition 0's first records", func() bool { return rec.count(0) == 10 })
	if err := cl.ProduceSync(context.Background(), append(produce(0, 10, 10), produce(1, 0, 10)...)...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	tps := []store.TopicPartition{{Topic: topic, Partition: 0}, {Topic: topic, Partition: 1}}
	waitFor(t, time.Minute, "both partitions applied to their ends", func() bool {
		stored, err := st.OffsetsLoad(context.Background(), topic+"-g", tps)
		return err == nil && stored[tps[0]] == 20 && stored[tps[1]] == 10
	})
	stop()
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if got, want := rec.committed[1], []int64{0, 1, 2, 3, 4, 6, 7, 8, 9}; !slices.Equal(got, want) {
		t.Errorf("partition 1: committed %v, want %v (5 dead-lettered)", got, want)
	}
	if got := rec.committed[0]; !slices.Equal(got, []int64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19}) {
		t.Errorf("partition 0: committed %v, want 0..9 then 12..19", got)
	}
}

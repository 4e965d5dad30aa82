package consumer

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/kafkaconn"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// intakeRig is a consumer group (intake, or responses) on its own topic
// (two partitions) and database, run until the test ends.
type intakeRig struct {
	t     *testing.T
	st    *store.Store
	k     *kafkatest.Cluster
	topic string
	group string
	in    *Intake // nil for responses
	g     *group
	m     *metrics.Metrics
}

func newIntakeRig(t *testing.T, stallAfter time.Duration, setup string) *intakeRig {
	t.Helper()
	r := newRig(t, "jobs", setup)
	in, err := NewIntake(zaptest.NewLogger(t), r.st, IntakeConfig{GroupConfig: r.config(stallAfter), MaxBytes: 4096, Types: outboxTypes})
	if err != nil {
		t.Fatal(err)
	}
	r.in, r.g = in, in.g
	r.run(in.Run)
	return r
}

// newResponsesRig is a response consumer's rig.
func newResponsesRig(t *testing.T, stallAfter time.Duration, setup string) *intakeRig {
	t.Helper()
	r := newRig(t, "replies", setup)
	rs, err := NewResponses(zaptest.NewLogger(t), r.st, ResponsesConfig{GroupConfig: r.config(stallAfter), Types: outboxTypes})
	if err != nil {
		t.Fatal(err)
	}
	r.g = rs.g
	r.run(rs.Run)
	return r
}

func newRig(t *testing.T, topic, setup string) *intakeRig {
	t.Helper()
	r := &intakeRig{t: t, st: pgtest.New(t), k: kafkatest.New(t), m: metrics.New()}
	if _, err := r.st.Pool().Exec(context.Background(), setup); err != nil {
		t.Fatal(err)
	}
	r.topic = r.k.Topic(topic)
	r.group = r.topic + "-g"
	r.k.CreateTopics(2, r.topic)
	return r
}

func (r *intakeRig) config(stallAfter time.Duration) GroupConfig {
	return GroupConfig{Kafka: kafkaconn.Config{Brokers: r.k.Brokers}, Group: r.group, Topics: []string{r.topic}, Metrics: r.m,
		StallAfter: stallAfter, SessionTimeout: 6 * time.Second}
}

func (r *intakeRig) run(run func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = run(ctx) }()
	r.t.Cleanup(func() { cancel(); wg.Wait() })
}

// produce writes job requests for keys to partition p, in order; a key
// "!" is a record that is not JSON.
func (r *intakeRig) produce(p int32, keys ...string) {
	r.t.Helper()
	var recs []*kgo.Record
	for _, k := range keys {
		v := fmt.Appendf(nil, `{"job_type": "t", "job_key": %q}`, k)
		if k == "!" {
			v = []byte("not json")
		}
		recs = append(recs, &kgo.Record{Topic: r.topic, Partition: p, Value: v})
	}
	r.send(recs...)
}

// reply writes replies (succeeded, attempt 1) to partition p, in order,
// each naming a job by "type/key".
func (r *intakeRig) reply(p int32, jobs ...string) {
	r.t.Helper()
	var recs []*kgo.Record
	for _, j := range jobs {
		typ, key, _ := strings.Cut(j, "/")
		recs = append(recs, &kgo.Record{Topic: r.topic, Partition: p, Value: []byte(`{"status": "succeeded"}`),
			Headers: []kgo.RecordHeader{{Key: correlator.HeaderJobType, Value: []byte(typ)},
				{Key: correlator.HeaderJobKey, Value: []byte(key)}, {Key: correlator.HeaderAttempt, Value: []byte("1")}}})
	}
	r.send(recs...)
}

func (r *intakeRig) send(recs ...*kgo.Record) {
	r.t.Helper()
	cl := r.k.Client(kgo.RecordPartitioner(kgo.ManualPartitioner()))
	defer cl.Close()
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		r.t.Fatal(err)
	}
}

func (r *intakeRig) count(q string) int { r.t.Helper(); return count(r.t, r.st, q) }

func (r *intakeRig) stalled(reason string) (float64, bool) {
	return r.m.Value("hipq_consumer_stalled", map[string]string{"group": r.group, "reason": reason})
}

// running makes jobs of type t with keys, each running its attempt 1.
func (r *intakeRig) running(keys ...string) {
	r.t.Helper()
	ctx := context.Background()
	var jobs []*correlator.Job
	for _, k := range keys {
		j, err := correlator.DecodeJob(fmt.Appendf(nil, `{"job_type": "t", "job_key": %q}`, k), 4096, outboxTypes, time.Now())
		if err != nil {
			r.t.Fatal(err)
		}
		jobs = append(jobs, j)
	}
	if n, err := r.st.JobsInsert(ctx, jobs); err != nil || n != len(jobs) {
		r.t.Fatalf("inserted %d of %d jobs: %v", n, len(jobs), err)
	}
	if c, err := r.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: len(jobs), Instance: "i"}); err != nil || len(c.Jobs) != len(jobs) {
		r.t.Fatalf("claimed %d of %d jobs: %v", len(c.Jobs), len(jobs), err)
	}
}

// holds is how many partitions wait on a hold, and how many of them on
// one shown to be systemic.
func (r *intakeRig) holds() (all, systemic int) {
	g := r.g
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, h := range g.holds {
		all++
		if h.systemic {
			systemic++
		}
	}
	return all, systemic
}

// tries is how often each partition's held record was tried.
func (r *intakeRig) tries() [2]int {
	g := r.g
	g.mu.Lock()
	defer g.mu.Unlock()
	var out [2]int
	for tp, h := range g.holds {
		out[tp.Partition] = h.tries
	}
	return out
}

// brokenTrigger makes every insert into hipq_job fail with SQLSTATE XX000
// while the table broken has a row: a trigger bug, not the records'.
const brokenTrigger = `
	CREATE TABLE broken (on_purpose bool);
	INSERT INTO broken VALUES (true);
	CREATE FUNCTION refuse_all() RETURNS trigger LANGUAGE plpgsql AS $$
	BEGIN
	  IF EXISTS (SELECT 1 FROM broken) THEN RAISE EXCEPTION 'trigger bug on %', NEW.job_key USING ERRCODE = 'XX000'; END IF;
	  RETURN NEW;
	END $$;
	CREATE TRIGGER refuse_all BEFORE INSERT ON hipq_job FOR EACH ROW EXECUTE FUNCTION refuse_all();`

// Issue 30.5: a refusal that is not the records' own (here a trigger
// failing on every row) dead-letters nothing and moves no offset: the
// partitions wait, hipq_consumer_stalled{group,reason} is 1 and the
// consumer says why (readiness), while records go on arriving. A
// partition with a single record waiting counts the other partition's
// refusal as the record after it, and a record that is only a dead letter
// (not JSON) is no record to compare with: it writes no job. Once the
// error stops, every record becomes its job exactly once and the stall is
// over.
func TestSystemicRefusalStallsInsteadOfDeadLettering(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	r := newIntakeRig(t, time.Hour, brokenTrigger)
	r.produce(0, "a0", "!", "a1", "a2", "a3", "a4")
	r.produce(1, "b0")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		all, sys := r.holds()
		v, _ := r.stalled("XX000")
		return sys == 2 && v == 1, fmt.Sprintf("%d holds, %d systemic, gauge %v", all, sys, v)
	}, "both partitions stalled")
	if err := r.in.Stalled(); err == nil || !strings.Contains(err.Error(), "XX000") || !strings.Contains(err.Error(), r.group) {
		t.Fatalf("Stalled() = %v, want the group and the SQLSTATE named", err)
	}
	// Records go on arriving while it stalls, and are tried (each try
	// reads the partition again from its held record); none is
	// dead-lettered.
	before := r.tries()
	r.produce(0, "a5", "a6")
	r.produce(1, "b1")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		now := r.tries()
		return now[0] >= before[0]+2 && now[1] >= before[1]+2, fmt.Sprintf("tries %v, then %v", before, now)
	}, "two more tries of each partition")
	if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
		t.Fatalf("%d dead letters while the trigger refused every record", n)
	}
	if n := r.count(`SELECT count(*) FROM hipq_offset`); n != 0 {
		t.Fatalf("%d offsets stored while nothing was applied", n)
	}
	if _, err := r.st.Pool().Exec(context.Background(), `DELETE FROM broken`); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		n := r.count(`SELECT count(*) FROM hipq_job`)
		return n == 9, fmt.Sprintf("%d of 9 jobs", n)
	}, "every record a job once the error stops")
	if n := r.count(`SELECT count(DISTINCT job_key) FROM hipq_job`); n != 9 {
		t.Fatalf("%d distinct keys among 9 jobs", n)
	}
	if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 1 || r.count(`SELECT count(*) FROM hipq_dead_letter
		WHERE kafka_partition = 0 AND kafka_offset = 1 AND reason LIKE 'invalid_json%'`) != 1 {
		t.Fatalf("%d dead letters, want the record that is not JSON alone", n)
	}
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		v, _ := r.stalled("XX000")
		all, _ := r.holds()
		return v == 0 && all == 0 && r.in.Stalled() == nil, fmt.Sprintf("gauge %v, %d holds, %v", v, all, r.in.Stalled())
	}, "the stall over")
	if n := r.count(`SELECT coalesce(sum(next_offset), 0) FROM hipq_offset`); n != 10 {
		t.Fatalf("stored offsets sum to %d, want 8 + 2", n)
	}
}

// Issue 30.5: a trigger raising XX000 on one record alone dead-letters
// that record, and its partition moves on: the record after it shows the
// refusal was the record's own. Nothing stalls.
func TestOneRecordsRefusalDeadLettersItAlone(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	r := newIntakeRig(t, time.Hour, refuseWhen("NEW.job_key = 'poison'"))
	r.produce(0, "k0", "k1", "poison", "k3", "k4")
	r.produce(1, "m0", "m1")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := r.count(`SELECT count(*) FROM hipq_job`)
		return n == 6, fmt.Sprintf("%d of 6 jobs", n)
	}, "the records around the refused one stored")
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		n := r.count(`SELECT count(*) FROM hipq_dead_letter WHERE kafka_partition = 0 AND kafka_offset = 2
			AND reason LIKE 'rejected: PostgreSQL refused it: %refused for poison%'`)
		return n == 1, fmt.Sprintf("%d dead letters", n)
	}, "the refused record dead-lettered")
	if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 1 {
		t.Fatalf("%d dead letters, want the refused record's alone", n)
	}
	if v, _ := r.stalled("XX000"); v != 0 || r.in.Stalled() != nil {
		t.Fatalf("stalled: gauge %v, %v", v, r.in.Stalled())
	}
}

// Issue 30.5: a record refused alone (XX000) with no record after it to
// compare with waits for one; when one comes and goes through, the
// refused record is dead-lettered at once. Nothing is dead-lettered on a
// timer (on a quiet topic every record would be, through an outage): with
// none coming, the partition is reported as stalled once it waited
// StallAfter, until a record after it settles it or the error stops.
func TestLoneRefusedRecord(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	refuse := refuseWhen("NEW.job_key LIKE 'poison%'")
	t.Run("a record after it comes", func(t *testing.T) {
		t.Parallel()
		r := newIntakeRig(t, time.Hour, refuse)
		r.produce(0, "k0", "poison")
		testutil.Eventually(t, 30*time.Second, func() (bool, string) {
			all, sys := r.holds()
			return all == 1 && sys == 0 && r.count(`SELECT count(*) FROM hipq_job`) == 1, fmt.Sprintf("%d holds, %d systemic", all, sys)
		}, "the partition waiting on the last record")
		if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
			t.Fatalf("%d dead letters before anything could be compared", n)
		}
		r.produce(0, "k2")
		testutil.Eventually(t, 30*time.Second, func() (bool, string) {
			j := r.count(`SELECT count(*) FROM hipq_job WHERE job_key = 'k2'`)
			d := r.count(`SELECT count(*) FROM hipq_dead_letter WHERE kafka_offset = 1`)
			return j == 1 && d == 1, fmt.Sprintf("%d jobs k2, %d dead letters", j, d)
		}, "the record after it a job, the refused one dead-lettered")
		if v, _ := r.stalled("XX000"); v != 0 {
			t.Fatalf("stalled gauge %v", v)
		}
	})
	t.Run("none comes", func(t *testing.T) {
		t.Parallel()
		r := newIntakeRig(t, 500*time.Millisecond, refuse)
		r.produce(1, "poison-alone")
		testutil.Eventually(t, 30*time.Second, func() (bool, string) {
			v, _ := r.stalled("XX000")
			all, _ := r.holds()
			return v == 1 && all == 1 && r.in.Stalled() != nil, fmt.Sprintf("gauge %v, %d holds, %v", v, all, r.in.Stalled())
		}, "the lone refused record reported as a stall")
		if err := r.in.Stalled(); !strings.Contains(err.Error(), "XX000") || !strings.Contains(err.Error(), "/1 at offset 0") {
			t.Fatalf("Stalled() = %v, want the SQLSTATE and the record named", err)
		}
		if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
			t.Fatalf("%d dead letters with nothing to compare the record with", n)
		}
		r.produce(1, "k1")
		testutil.Eventually(t, 30*time.Second, func() (bool, string) {
			j := r.count(`SELECT count(*) FROM hipq_job WHERE job_key = 'k1'`)
			d := r.count(`SELECT count(*) FROM hipq_dead_letter WHERE reason LIKE '%refused for poison-alone%'`)
			return j == 1 && d == 1, fmt.Sprintf("%d jobs k1, %d dead letters", j, d)
		}, "the record after it a job, the refused one dead-lettered")
		testutil.Eventually(t, 10*time.Second, func() (bool, string) {
			v, _ := r.stalled("XX000")
			return v == 0 && r.in.Stalled() == nil, fmt.Sprintf("gauge %v, %v", v, r.in.Stalled())
		}, "the stall over")
	})
	t.Run("under a refusal of every record", func(t *testing.T) {
		t.Parallel()
		r := newIntakeRig(t, 500*time.Millisecond, brokenTrigger)
		r.produce(0, "only")
		testutil.Eventually(t, 30*time.Second, func() (bool, string) {
			v, _ := r.stalled("XX000")
			return v == 1 && r.in.Stalled() != nil, fmt.Sprintf("gauge %v, %v", v, r.in.Stalled())
		}, "the lone refused record reported as a stall")
		if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
			t.Fatalf("%d dead letters while the trigger refused every record", n)
		}
		if _, err := r.st.Pool().Exec(context.Background(), `DELETE FROM broken`); err != nil {
			t.Fatal(err)
		}
		testutil.Eventually(t, 60*time.Second, func() (bool, string) {
			n := r.count(`SELECT count(*) FROM hipq_job WHERE job_key = 'only'`)
			v, _ := r.stalled("XX000")
			return n == 1 && v == 0 && r.in.Stalled() == nil, fmt.Sprintf("%d jobs, gauge %v", n, v)
		}, "the record a job once the error stops")
		if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
			t.Fatalf("%d dead letters", n)
		}
	})
}

// afterTrigger makes every job inserted fail with SQLSTATE XX000 while
// the table broken has a row, after the insert: a request for a job that
// exists already inserts nothing and so never meets it.
const afterTrigger = `
	CREATE TABLE broken (on_purpose bool);
	CREATE FUNCTION refuse_all() RETURNS trigger LANGUAGE plpgsql AS $$
	BEGIN
	  IF EXISTS (SELECT 1 FROM broken) THEN RAISE EXCEPTION 'audit trigger bug on %', NEW.job_key USING ERRCODE = 'XX000'; END IF;
	  RETURN NEW;
	END $$;
	CREATE TRIGGER refuse_all AFTER INSERT ON hipq_job FOR EACH ROW EXECUTE FUNCTION refuse_all();`

// Issue 30.5: a record after the refused one that decodes but writes
// nothing (a duplicate request) never meets the write refused, so its
// going through shows nothing: under a trigger failing every insert, a
// refused record followed by a duplicate is not dead-lettered; the record
// after the duplicate is the one compared with, and the partition stalls.
func TestDuplicateAfterARefusalIsNoComparison(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	r := newIntakeRig(t, time.Hour, afterTrigger)
	r.produce(0, "dup")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := r.count(`SELECT count(*) FROM hipq_job`)
		return n == 1, fmt.Sprintf("%d jobs", n)
	}, "the first request a job")
	if _, err := r.st.Pool().Exec(context.Background(), `INSERT INTO broken VALUES (true)`); err != nil {
		t.Fatal(err)
	}
	r.produce(0, "a", "dup", "b", "c")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		all, sys := r.holds()
		v, _ := r.stalled("XX000")
		return sys == 1 && v == 1, fmt.Sprintf("%d holds, %d systemic, gauge %v", all, sys, v)
	}, "the partition stalled")
	if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
		t.Fatalf("%d dead letters while the trigger refused every insert", n)
	}
	if n := r.count(`SELECT next_offset FROM hipq_offset`); n != 1 {
		t.Fatalf("next offset %d, want 1: nothing applied past the first request", n)
	}
	if _, err := r.st.Pool().Exec(context.Background(), `DELETE FROM broken`); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		n := r.count(`SELECT count(*) FROM hipq_job`)
		o := r.count(`SELECT next_offset FROM hipq_offset`)
		return n == 4 && o == 5, fmt.Sprintf("%d of 4 jobs, next offset %d of 5", n, o)
	}, "every request a job once the error stops")
	if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
}

// Issue 30.5: replies that decode but write nothing (a reply to a job type
// not configured, a duplicate) are no records to compare a refused reply
// with: under a trigger failing every update of a job, the reply refused
// is not dead-lettered for them; the next reply that applies is refused
// the same way and the partition stalls. Once the error stops, every
// reply is applied once.
func TestRepliesThatWriteNothingAreNoComparison(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	r := newResponsesRig(t, time.Hour, strings.Replace(brokenTrigger, "BEFORE INSERT", "BEFORE UPDATE", 1))
	if _, err := r.st.Pool().Exec(context.Background(), `DELETE FROM broken`); err != nil {
		t.Fatal(err)
	}
	r.running("r0", "r1", "r2", "done")
	r.reply(1, "t/done")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := r.count(`SELECT count(*) FROM hipq_job WHERE state = 'final'`)
		return n == 1, fmt.Sprintf("%d final jobs", n)
	}, "the first reply applied")
	if _, err := r.st.Pool().Exec(context.Background(), `INSERT INTO broken VALUES (true)`); err != nil {
		t.Fatal(err)
	}
	r.reply(0, "t/r0", "nope/x", "t/done", "t/r1", "t/r2")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		all, sys := r.holds()
		v, _ := r.stalled("XX000")
		return sys == 1 && v == 1, fmt.Sprintf("%d holds, %d systemic, gauge %v", all, sys, v)
	}, "the partition stalled")
	if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
		t.Fatalf("%d dead letters while the trigger refused every update", n)
	}
	if _, err := r.st.Pool().Exec(context.Background(), `DELETE FROM broken`); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		n := r.count(`SELECT count(*) FROM hipq_job WHERE state = 'final'`)
		return n == 4, fmt.Sprintf("%d of 4 final jobs", n)
	}, "every reply applied once the error stops")
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		n := r.count(`SELECT count(*) FROM hipq_dead_letter WHERE reason LIKE 'unknown_job_type%'`)
		return n == 1, fmt.Sprintf("%d dead letters", n)
	}, "the reply to a type not configured dead-lettered alone")
	if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 1 {
		t.Fatalf("%d dead letters, want the reply to a type not configured alone", n)
	}
}

// Issue 30.5: the same input sent twice after itself is no record to
// compare it with: refused for its own fault, it would be refused the same
// way again. The refused record is compared with the next record that is
// another input, and the copies between are dead-lettered with it: the
// partition moves on instead of stalling for ever on one bad input.
func TestSameInputTwiceIsNoComparison(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	const refuse = `
		CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused for %', OLD.job_key USING ERRCODE = 'XX000'; END $$;`
	t.Run("intake", func(t *testing.T) {
		t.Parallel()
		r := newIntakeRig(t, time.Hour, strings.ReplaceAll(refuse, "OLD.", "NEW.")+`
			CREATE TRIGGER refuse BEFORE INSERT ON hipq_job FOR EACH ROW WHEN (NEW.job_key = 'poison') EXECUTE FUNCTION refuse();`)
		r.produce(0, "k0", "poison", "poison", "k3")
		testutil.Eventually(t, 20*time.Second, func() (bool, string) {
			n := r.count(`SELECT count(*) FROM hipq_job WHERE job_key IN ('k0', 'k3')`)
			return n == 2, fmt.Sprintf("%d of 2 jobs", n)
		}, "the records around the copies stored")
		if n := r.count(`SELECT count(*) FROM hipq_dead_letter WHERE reason LIKE '%refused for poison%'`); n != 2 ||
			r.count(`SELECT count(*) FROM hipq_dead_letter`) != 2 {
			t.Fatalf("%d dead letters, want both copies", r.count(`SELECT count(*) FROM hipq_dead_letter`))
		}
		if v, _ := r.stalled("XX000"); v != 0 || r.in.Stalled() != nil {
			t.Fatalf("stalled: gauge %v, %v", v, r.in.Stalled())
		}
	})
	t.Run("responses", func(t *testing.T) {
		t.Parallel()
		r := newResponsesRig(t, time.Hour, refuse)
		r.running("poison", "k")
		if _, err := r.st.Pool().Exec(context.Background(), `
			CREATE TRIGGER refuse BEFORE UPDATE ON hipq_job FOR EACH ROW WHEN (OLD.job_key = 'poison') EXECUTE FUNCTION refuse();`); err != nil {
			t.Fatal(err)
		}
		r.reply(0, "t/poison", "t/poison", "t/k")
		testutil.Eventually(t, 20*time.Second, func() (bool, string) {
			n := r.count(`SELECT count(*) FROM hipq_job WHERE job_key = 'k' AND state = 'final'`)
			return n == 1, fmt.Sprintf("%d of 1 jobs final", n)
		}, "the reply after the copies applied")
		if n := r.count(`SELECT count(*) FROM hipq_dead_letter WHERE reason LIKE '%refused for poison%'`); n != 2 ||
			r.count(`SELECT count(*) FROM hipq_dead_letter`) != 2 {
			t.Fatalf("%d dead letters, want both copies", r.count(`SELECT count(*) FROM hipq_dead_letter`))
		}
		if v, _ := r.stalled("XX000"); v != 0 || r.g.Stalled() != nil {
			t.Fatalf("stalled: gauge %v, %v", v, r.g.Stalled())
		}
	})
}

// refuseDeadLetters makes a job_key 'bad' a data error (22023) and every
// dead letter fail with XX000: the dead-letter table is broken.
const refuseDeadLetters = `
	CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
	BEGIN RAISE EXCEPTION 'bad value %', NEW.job_key USING ERRCODE = '22023'; END $$;
	CREATE TRIGGER refuse BEFORE INSERT ON hipq_job FOR EACH ROW WHEN (NEW.job_key = 'bad') EXECUTE FUNCTION refuse();
	CREATE FUNCTION refuse_dl() RETURNS trigger LANGUAGE plpgsql AS $$
	BEGIN RAISE EXCEPTION 'dead letter table broken' USING ERRCODE = 'XX000'; END $$;
	CREATE TRIGGER refuse_dl BEFORE INSERT ON hipq_dead_letter FOR EACH ROW EXECUTE FUNCTION refuse_dl();`

// Issue 30.5: a record's dead letter refused for a reason that is not its
// data (the dead-letter table broken) stalls its partition, and says so:
// hipq_consumer_stalled and readiness, not a silent retry. Once the
// dead letter is taken, the partition moves on.
func TestRefusedDeadLetterStalls(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	r := newIntakeRig(t, time.Hour, refuseDeadLetters)
	r.produce(0, "k0", "bad", "k2")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		v, _ := r.stalled("XX000")
		return v == 1 && r.in.Stalled() != nil, fmt.Sprintf("gauge %v, %v", v, r.in.Stalled())
	}, "the partition stalled on the dead letter")
	if !strings.Contains(r.in.Stalled().Error(), "dead letter table broken") {
		t.Fatalf("Stalled() = %v, want the dead letter's refusal", r.in.Stalled())
	}
	if n := r.count(`SELECT count(*) FROM hipq_job WHERE job_key = 'k2'`); n != 0 {
		t.Fatalf("the record after the one held applied")
	}
	if _, err := r.st.Pool().Exec(context.Background(), `DROP TRIGGER refuse_dl ON hipq_dead_letter`); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		j := r.count(`SELECT count(*) FROM hipq_job WHERE job_key IN ('k0', 'k2')`)
		d := r.count(`SELECT count(*) FROM hipq_dead_letter WHERE kafka_offset = 1 AND reason LIKE '%bad value bad%'`)
		v, _ := r.stalled("XX000")
		return j == 2 && d == 1 && v == 0 && r.in.Stalled() == nil, fmt.Sprintf("%d of 2 jobs, %d dead letters, gauge %v", j, d, v)
	}, "the dead letter taken and the partition on")
}

// A hold on a record another consumer has applied meanwhile (its offset
// below the stored one, found by an offset conflict) is over: the stall
// it reported goes back to 0.
func TestOffsetConflictEndsAPassedHold(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	r := newIntakeRig(t, time.Nanosecond, refuseWhen("NEW.job_key = 'poison'"))
	r.produce(1, "poison")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		v, _ := r.stalled("XX000")
		return v == 1, fmt.Sprintf("gauge %v", v)
	}, "the lone refused record reported as a stall")
	// Another consumer of the group dead-letters it and stores the offset past it.
	if _, err := r.st.Pool().Exec(context.Background(), `INSERT INTO hipq_offset (consumer_group, topic, kafka_partition, next_offset)
		VALUES ($1, $2, 1, 1)`, r.group, r.topic); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		v, _ := r.stalled("XX000")
		all, _ := r.holds()
		return v == 0 && all == 0 && r.in.Stalled() == nil, fmt.Sprintf("gauge %v, %d holds, %v", v, all, r.in.Stalled())
	}, "the hold over")
	r.produce(1, "k1")
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := r.count(`SELECT count(*) FROM hipq_job WHERE job_key = 'k1'`)
		return n == 1, fmt.Sprintf("%d jobs", n)
	}, "the partition read on")
}

// refusedTwice makes the first two inserts (or updates, with "UPDATE")
// of the job with key "a" fail with XX000, and any later one go through:
// a refusal that stops between a record's try alone and its comparison
// with the record after it (a privilege granted back just then). The
// sequence tries counts the tries, rolled back or not.
func refusedTwice(event string) string {
	return `
		CREATE SEQUENCE tries;
		CREATE FUNCTION refuse_twice() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF nextval('tries') <= 2 THEN RAISE EXCEPTION 'refused for %, try %', NEW.job_key, currval('tries') USING ERRCODE = 'XX000'; END IF;
		  RETURN NEW;
		END $$;
		CREATE TRIGGER refuse_twice BEFORE ` + event + ` ON hipq_job FOR EACH ROW WHEN (NEW.job_key = 'a') EXECUTE FUNCTION refuse_twice();`
}

// Issue 30.5: a refusal that stops between a record's try alone and the
// comparison with the record after it is no refusal of the record's own:
// the record is tried again after the record after it went through, in
// the same transaction, and becomes its job (its reply applied); nothing
// is dead-lettered. Two records in one produce come in one fetch: the
// batch is refused (try 1), the record alone (try 2), and the comparison
// writes the record after it and then the record (try 3).
func TestRefusalThatStopsBeforeTheComparison(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	t.Run("intake", func(t *testing.T) {
		t.Parallel()
		r := newIntakeRig(t, time.Hour, refusedTwice("INSERT"))
		r.produce(0, "a", "b")
		testutil.Eventually(t, 30*time.Second, func() (bool, string) {
			n := r.count(`SELECT count(*) FROM hipq_job`)
			return n == 2, fmt.Sprintf("%d of 2 jobs", n)
		}, "both records stored")
		r.refusedOnceAfterTheOther()
	})
	t.Run("replies", func(t *testing.T) {
		t.Parallel()
		r := newResponsesRig(t, time.Hour, "")
		r.running("a", "b")
		if _, err := r.st.Pool().Exec(context.Background(), refusedTwice("UPDATE")); err != nil {
			t.Fatal(err)
		}
		r.reply(0, "t/a", "t/b")
		testutil.Eventually(t, 30*time.Second, func() (bool, string) {
			n := r.count(`SELECT count(*) FROM hipq_job WHERE state = 'final' AND outcome = 'succeeded'`)
			return n == 2, fmt.Sprintf("%d of 2 jobs succeeded", n)
		}, "both replies applied")
		r.refusedOnceAfterTheOther()
	})
}

// refusedOnceAfterTheOther checks the end of TestRefusalThatStopsBeforeTheComparison:
// three tries, no dead letter, no hold, no stall.
func (r *intakeRig) refusedOnceAfterTheOther() {
	r.t.Helper()
	if n := r.count(`SELECT last_value FROM tries`); n != 3 {
		r.t.Fatalf("the refused record was tried %d times, want 3 (the batch, alone, after the other)", n)
	}
	if n := r.count(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
		r.t.Fatalf("%d dead letters, want none: the refusal had stopped when the record after it went through", n)
	}
	if all, _ := r.holds(); all != 0 {
		r.t.Fatalf("%d partitions still wait", all)
	}
	if v, _ := r.stalled("XX000"); v != 0 || r.g.Stalled() != nil {
		r.t.Fatalf("stalled: gauge %v, %v", v, r.g.Stalled())
	}
}

// refuseWhen makes every insert into hipq_job of a row meeting when fail
// with SQLSTATE XX000 ("refused for KEY"): a refusal of those records
// alone, not of their data.
func refuseWhen(when string) string {
	return `
		CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused for %', NEW.job_key USING ERRCODE = 'XX000'; END $$;
		CREATE TRIGGER refuse BEFORE INSERT ON hipq_job FOR EACH ROW WHEN (` + when + `) EXECUTE FUNCTION refuse();`
}

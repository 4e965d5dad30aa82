package dispatcher_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/pgtest"
	tu "github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// eventRig is a database whose job types publish outcome events, a kfake
// cluster that creates no topic by itself, and a producer that gives a
// missing topic up fast.
type eventRig struct {
	t     *testing.T
	st    *store.Store
	types correlator.Types
	fake  *kfake.Cluster
	cl    *kgo.Client
}

// newEventRig: each type of topics (type name → topic) publishes there,
// each retry too (two attempts), and allows reply_to topics "rep.*".
func newEventRig(t *testing.T, topics map[string]string, existing ...string) *eventRig {
	t.Helper()
	tys := correlator.Types{}
	for name, topic := range topics {
		tys[name] = &correlator.JobType{Name: name, Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce,
			Retry:          &correlator.Backoff{Attempts: 2, When: []correlator.AttemptOutcome{correlator.AttemptFailed}},
			Events:         correlator.Events{Topic: topic, Attempts: true},
			AllowedReplyTo: []string{"rep.*"}}
	}
	fake, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.DefaultNumPartitions(3), kfake.SeedTopics(3, existing...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fake.Close)
	cl, err := kgo.NewClient(append(dispatcher.KafkaProducerOpts(), kgo.SeedBrokers(fake.ListenAddrs()...),
		kgo.MetadataMinAge(50*time.Millisecond), kgo.UnknownTopicRetries(1), kgo.RecordDeliveryTimeout(time.Second))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return &eventRig{t: t, st: pgtest.New(t).WithEvents(store.EventsOf(tys)), types: tys, fake: fake, cl: cl}
}

func (r *eventRig) relay(m *metrics.Metrics) *dispatcher.Relay {
	return dispatcher.NewRelay(zaptest.NewLogger(r.t), r.st, r.cl, dispatcher.RelayConfig{Interval: 50 * time.Millisecond,
		BatchSize: 50, MaxBackoff: 200 * time.Millisecond, Metrics: m})
}

// run runs relays until the test ends.
func (r *eventRig) run(relays ...*dispatcher.Relay) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, rl := range relays {
		wg.Add(1)
		go func() { defer wg.Done(); _ = rl.Run(ctx) }()
	}
	r.t.Cleanup(func() { cancel(); wg.Wait() })
}

// insert makes jobs of typ, keys prefix0..prefix(n-1), each changed by opts.
func (r *eventRig) insert(typ, prefix string, n int, opts ...func(*correlator.Job)) {
	r.t.Helper()
	var jobs []*correlator.Job
	for i := range n {
		j := &correlator.Job{Queue: "default", JobType: typ, JobKey: prefix + strconv.Itoa(i), JobData: json.RawMessage(`{}`),
			MaxAttempts: 2, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)}
		for _, o := range opts {
			o(j)
		}
		jobs = append(jobs, j)
	}
	if _, err := r.st.JobsInsert(ctx, jobs); err != nil {
		r.t.Fatal(err)
	}
}

// answer claims every due job and replies to each: ok or a failure (a
// retry, due at once, or the end of its last attempt).
func (r *eventRig) answer(ok bool) int {
	r.t.Helper()
	c, err := r.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 1000, Instance: "test"})
	if err != nil {
		r.t.Fatal(err)
	}
	var ins []store.ReplyIn
	for _, j := range c.Jobs {
		att := j.Attempt
		ins = append(ins, store.ReplyIn{Kind: store.SourceReply, Reply: &correlator.Reply{JobType: j.JobType, JobKey: j.JobKey, Attempt: &att,
			Success: ok, Retryable: true, Error: map[bool]string{false: "nope"}[ok], Result: json.RawMessage(`{"n":` + strconv.Itoa(att) + `}`)}})
	}
	res, err := r.st.ReplyApply(ctx, store.ReplyBatch{Replies: ins, EarlyTTL: time.Minute}, r.types)
	if err != nil {
		r.t.Fatal(err)
	}
	if len(res.Applied) != len(ins) {
		r.t.Fatalf("%d of %d replies applied", len(res.Applied), len(ins))
	}
	return len(ins)
}

// reader reads topics from their start.
type reader struct {
	t    *testing.T
	cl   *kgo.Client
	recs []*kgo.Record
}

func (r *eventRig) reader(topics ...string) *reader {
	cl, err := kgo.NewClient(kgo.SeedBrokers(r.fake.ListenAddrs()...), kgo.ConsumeTopics(topics...),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.MetadataMinAge(50*time.Millisecond))
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(cl.Close)
	return &reader{t: r.t, cl: cl}
}

// until reads until cond holds of what was read, or fails after a minute.
func (rd *reader) until(what string, cond func([]*kgo.Record) bool) {
	rd.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond(rd.recs) {
		if time.Now().After(deadline) {
			rd.t.Fatalf("waited a minute for %s; read %d records", what, len(rd.recs))
		}
		pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		fs := rd.cl.PollFetches(pctx)
		cancel()
		fs.EachRecord(func(r *kgo.Record) { rd.recs = append(rd.recs, r) })
	}
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func ofTopic(recs []*kgo.Record, topic string) []*kgo.Record {
	var out []*kgo.Record
	for _, r := range recs {
		if r.Topic == topic {
			out = append(out, r)
		}
	}
	return out
}

// Each event reaches its topic once, keyed by its job key, with the
// headers and value of docs/messages.md; a job's reply_to gets its final
// event, with the correlation headers and traceparent it came with; sent
// events are deleted. Two relays run at once, and still each event is sent
// once: one holds the relay's lock.
func TestRelayProducesEvents(t *testing.T) {
	t.Parallel()
	r := newEventRig(t, map[string]string{"t": "ev"}, "ev", "rep.a")
	r.insert("t", "k", 5)
	r.insert("t", "asker", 1, func(j *correlator.Job) {
		j.ReplyTo = "rep.a"
		j.Correlation = []correlator.Header{{Key: "hipq-correlation-id", Value: []byte("c-1")}}
		j.Trace.Parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	})
	m, m2 := metrics.New(), metrics.New()
	r.run(r.relay(m), r.relay(m2))
	if n := r.answer(false); n != 6 { // attempt 1 fails: a retry event each
		t.Fatalf("answered %d", n)
	}
	r.answer(true) // attempt 2 succeeds: a final event each, and asker's reply_to gets one
	rd := r.reader("ev", "rep.a")
	rd.until("12 events and the reply_to one", func(rs []*kgo.Record) bool { return len(rs) >= 13 })
	ids := map[string]int{}
	byKey := map[string][]*kgo.Record{}
	for _, rec := range ofTopic(rd.recs, "ev") {
		ids[header(rec, correlator.HeaderEventID)]++
		byKey[string(rec.Key)] = append(byKey[string(rec.Key)], rec)
	}
	for id, n := range ids {
		if n != 1 {
			t.Errorf("event %s sent %d times, want once", id, n)
		}
	}
	for key, recs := range byKey {
		if len(recs) != 2 || header(recs[0], correlator.HeaderOutcome) != "retry" || header(recs[1], correlator.HeaderOutcome) != "succeeded" {
			t.Errorf("%s: outcomes %v, want retry then succeeded", key, outcomes(recs))
			continue
		}
		j, err := r.st.JobGet(ctx, "t", key)
		if err != nil {
			t.Fatal(err)
		}
		for i, rec := range recs {
			att := strconv.Itoa(i + 1)
			if header(rec, correlator.HeaderJobType) != "t" || header(rec, correlator.HeaderJobKey) != key ||
				header(rec, correlator.HeaderJobID) != strconv.FormatInt(j.ID, 10) || header(rec, correlator.HeaderAttempt) != att {
				t.Errorf("%s: headers %v", key, rec.Headers)
			}
			var v map[string]any
			if err := json.Unmarshal(rec.Value, &v); err != nil {
				t.Fatalf("%s: value %s: %v", key, rec.Value, err)
			}
			if v["job_key"] != key || v["attempt"] != float64(i+1) || v["outcome"] != header(rec, correlator.HeaderOutcome) {
				t.Errorf("%s: value %s", key, rec.Value)
			}
		}
		var last map[string]any
		_ = json.Unmarshal(recs[1].Value, &last)
		if fmt.Sprint(last["result"]) != "map[n:2]" || last["error"] != nil || last["state"] != "final" {
			t.Errorf("%s: final value %s", key, recs[1].Value)
		}
		if key == "asker0" && (header(recs[1], "hipq-correlation-id") != "c-1" || header(recs[1], correlator.HeaderTraceParent) == "") {
			t.Errorf("asker0: headers %v, want its correlation id and traceparent", recs[1].Headers)
		}
	}
	rep := ofTopic(rd.recs, "rep.a")
	if len(rep) != 1 || string(rep[0].Key) != "asker0" || header(rep[0], correlator.HeaderOutcome) != "succeeded" ||
		header(rep[0], "hipq-correlation-id") != "c-1" {
		t.Errorf("reply_to records %v, want asker0's final event with its correlation id", rep)
	}
	tu.Eventually(t, 10*time.Second, func() bool { return scalar(t, r.st, pgtest.PendingEventsSQL("")) == 0 }, "sent events deleted")
	// (Which relay sent them depends on which led: the lock may move while
	// a slow machine lets a lease check fail; each event was sent once.)
	sent := testutil.ToFloat64(m.Events.WithLabelValues("ev", "sent")) + testutil.ToFloat64(m2.Events.WithLabelValues("ev", "sent"))
	if sent != 12 {
		t.Errorf("hipq_events_total{ev,sent} = %v over both relays, want 12", sent)
	}
}

func outcomes(recs []*kgo.Record) []string {
	var out []string
	for _, r := range recs {
		out = append(out, header(r, correlator.HeaderOutcome))
	}
	return out
}

// A topic that refuses (missing) holds back its own events only: jobs keep
// ending, its events wait in PostgreSQL (hipq_events_pending) while
// another topic's flow; once it exists they all arrive, each key's in the
// order they happened.
func TestRelayRefusingTopicHoldsBackItsOwn(t *testing.T) {
	t.Parallel()
	r := newEventRig(t, map[string]string{"flows": "good", "waits": "late"}, "good")
	m := metrics.New()
	r.run(r.relay(m))
	r.insert("flows", "f", 10)
	r.insert("waits", "w", 10)
	r.answer(false) // retries
	rd := r.reader("good", "late")
	rd.until("the flowing topic's retry events", func(rs []*kgo.Record) bool { return len(ofTopic(rs, "good")) >= 10 })
	tu.Eventually(t, time.Minute, func() (bool, string) {
		refused := testutil.ToFloat64(m.Events.WithLabelValues("late", "refused"))
		pending := testutil.ToFloat64(m.EventsPending.WithLabelValues("late"))
		return refused > 0 && pending == 10, fmt.Sprintf("refused %v, pending %v", refused, pending)
	}, "the refusing topic's events counted refused and pending")
	// Jobs keep ending meanwhile.
	r.answer(true)
	rd.until("the flowing topic's final events", func(rs []*kgo.Record) bool { return len(ofTopic(rs, "good")) >= 20 })
	if n := scalar(t, r.st, pgtest.PendingEventsSQL("late")); n != 20 {
		t.Fatalf("%d events wait for the refusing topic, want 20", n)
	}
	if n := scalar(t, r.st, "SELECT count(*) FROM hipq_job WHERE state = 'final'"); n != 20 {
		t.Fatalf("%d jobs final, want 20: ending waits for no event", n)
	}
	// The topic takes events again.
	admin := kadm.NewClient(r.cl)
	if _, err := admin.CreateTopic(ctx, 3, 1, nil, "late"); err != nil {
		t.Fatal(err)
	}
	rd.until("the refusing topic's events", func(rs []*kgo.Record) bool { return len(ofTopic(rs, "late")) >= 20 })
	for _, topic := range []string{"good", "late"} {
		byKey := map[string][]*kgo.Record{}
		for _, rec := range ofTopic(rd.recs, topic) {
			byKey[string(rec.Key)] = append(byKey[string(rec.Key)], rec)
		}
		for key, recs := range byKey {
			if got := outcomes(recs); !slices.Equal(got, []string{"retry", "succeeded"}) {
				t.Errorf("%s %s: outcomes %v, want retry then succeeded", topic, key, got)
			}
		}
		if len(byKey) != 10 {
			t.Errorf("%s: events of %d keys, want 10", topic, len(byKey))
		}
	}
	tu.Eventually(t, 10*time.Second, func() bool { return scalar(t, r.st, pgtest.PendingEventsSQL("")) == 0 }, "every event deleted")
}

// relayedEnds makes a rig, ends n jobs of type t (keys prefix0…) with
// successes and relays their final events in one look, by the relay it
// returns.
func relayedEnds(t *testing.T, prefix string, n int) (*eventRig, *dispatcher.Relay) {
	t.Helper()
	r := newEventRig(t, map[string]string{"t": "ev"}, "ev")
	r.insert("t", prefix, n)
	r.answer(true)
	rl := r.relay(metrics.New())
	if sent, _, err := rl.RelayTopic(ctx, "ev"); err != nil || sent != n {
		t.Fatalf("first look: %d sent, %v; want %d", sent, err, n)
	}
	return r, rl
}

// A relay that dies between the broker's acknowledgement and the write
// that follows it (here: that write refused) leaves the events pending;
// they are sent again, with the same hipq-event-id: each event arrives at
// least once, none is lost. The jobs' final events are read from the
// jobs: what follows their sending is the write of the topic's cursor,
// made with the deletes of rows.
func TestRelaySendsAgainAfterALostDelete(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	r, rl := relayedEnds(t, "k", 20)
	if _, err := r.st.Pool().Exec(ctx, `
		CREATE FUNCTION refuse_write() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'down'; END $$;
		CREATE TRIGGER refuse_delete BEFORE DELETE ON hipq_event FOR EACH STATEMENT EXECUTE FUNCTION refuse_write();
		CREATE TRIGGER refuse_cursor BEFORE INSERT OR UPDATE ON hipq_event_cursor FOR EACH STATEMENT EXECUTE FUNCTION refuse_write()`); err != nil {
		t.Fatal(err)
	}
	// Its next looks find none pending and would keep the cursor past
	// the 20: refused.
	tu.Eventually(t, time.Minute, func() bool {
		_, _, err := rl.RelayTopic(ctx, "ev")
		return err != nil && strings.Contains(err.Error(), "down")
	}, "the cursor's write refused")
	if n := scalar(t, r.st, pgtest.PendingEventsSQL("")); n != 20 {
		t.Fatalf("%d events pending, want the 20 sent but not passed", n)
	}
	if _, err := r.st.Pool().Exec(ctx, `DROP TRIGGER refuse_delete ON hipq_event; DROP TRIGGER refuse_cursor ON hipq_event_cursor`); err != nil {
		t.Fatal(err)
	}
	// The next relay (after a crash) sends them again, and then keeps its
	// cursor past them.
	rl = r.relay(metrics.New())
	if n, more, err := rl.RelayTopic(ctx, "ev"); err != nil || n != 20 || more {
		t.Fatalf("relay again: %d sent (more %v), %v", n, more, err)
	}
	tu.Eventually(t, time.Minute, func() bool {
		if n, _, err := rl.RelayTopic(ctx, "ev"); err != nil || n != 0 {
			t.Fatalf("an idle look: %d sent, %v", n, err)
		}
		return scalar(t, r.st, pgtest.PendingEventsSQL("")) == 0
	}, "the cursor kept past the events")
	rd := r.reader("ev")
	rd.until("every event twice", func(rs []*kgo.Record) bool { return len(rs) >= 40 })
	ids := map[string]int{}
	for _, rec := range rd.recs {
		ids[header(rec, correlator.HeaderEventID)]++
	}
	if len(ids) != 20 {
		t.Errorf("%d event ids, want 20", len(ids))
	}
	for id, n := range ids {
		if n != 2 {
			t.Errorf("event %s sent %d times, want twice (once again after the lost write)", id, n)
		}
	}
}

// A relay that led, lost the lock while another relayed, and leads again
// starts from the cursor the other kept: it sends none of the other's
// events again (the final events read from jobs are never deleted).
func TestRelayLeadingAgainStartsFromTheCursorKept(t *testing.T) {
	pgtest.SkipOnCitus(t, "there every event is a row, deleted once relayed")
	t.Parallel()
	r, first := relayedEnds(t, "a", 5) // (its cursor, in memory, below b's events)
	r.insert("t", "b", 5)
	r.answer(true)
	other := r.relay(metrics.New())
	// (It starts at the cursor kept, which the first relay had not
	// written yet: a's events again, and b's.)
	if n, _, err := other.RelayTopic(ctx, "ev"); err != nil || (n != 5 && n != 10) {
		t.Fatalf("other relay: %d sent, %v", n, err)
	}
	tu.Eventually(t, time.Minute, func() bool {
		if _, _, err := other.RelayTopic(ctx, "ev"); err != nil {
			t.Fatal(err)
		}
		return scalar(t, r.st, pgtest.PendingEventsSQL("")) == 0
	}, "the other relay's cursor kept past b's events")
	keys := func(rs []*kgo.Record) map[string]int {
		out := map[string]int{}
		for _, rec := range rs {
			out[string(rec.Key)]++
		}
		return out
	}
	rd := r.reader("ev")
	rd.until("a's and b's events", func(rs []*kgo.Record) bool { return len(keys(rs)) == 10 })
	bs := keys(rd.recs)["b0"]
	r.insert("t", "c", 1)
	r.answer(true)
	r.run(first) // (it leads again)
	rd.until("c's event", func(rs []*kgo.Record) bool { return keys(rs)["c0"] == 1 })
	if got := keys(rd.recs)["b0"]; got != bs {
		t.Errorf("b0's event sent %d times, %d before the first relay led again", got, bs)
	}
}

// A batch takes each key's first pending event only: a key's later event
// is never sent before its earlier one is acknowledged.
func TestRelaySendsOneEventPerKeyAtATime(t *testing.T) {
	t.Parallel()
	r := newEventRig(t, map[string]string{"t": "ev"}, "ev")
	r.insert("t", "k", 3)
	r.answer(false)
	r.answer(true)
	rl := r.relay(metrics.New())
	n, more, err := rl.RelayTopic(ctx, "ev")
	if err != nil || n != 3 || !more {
		t.Fatalf("first batch: %d sent (more %v), %v; want each key's first event and more", n, more, err)
	}
	if got := scalar(t, r.st, pgtest.PendingEventsSQL("")); got != 3 {
		t.Fatalf("%d final events pending, want the 3 that wait for their keys' retries", got)
	}
	if n, _, err := rl.RelayTopic(ctx, "ev"); err != nil || n != 3 {
		t.Fatalf("second batch: %d sent, %v", n, err)
	}
}

// With more topics waiting than the relay drains at once (MaxDrains), it
// drains no more than that at a time, and every topic's events still go.
func TestRelayDrainsABoundedNumberOfTopicsAtOnce(t *testing.T) {
	t.Parallel()
	topics := map[string]string{}
	var names []string
	for i := range 6 {
		typ, topic := fmt.Sprintf("t%d", i), fmt.Sprintf("ev%d", i)
		topics[typ], names = topic, append(names, topic)
	}
	r := newEventRig(t, topics, names...)
	for typ := range topics {
		r.insert(typ, typ+"-", 3)
	}
	r.answer(true) // every job ends: 18 events in 6 topics, all waiting before the relay starts
	rl := dispatcher.NewRelay(zaptest.NewLogger(t), r.st, r.cl, dispatcher.RelayConfig{Interval: 50 * time.Millisecond,
		BatchSize: 1, MaxDrains: 2, MaxBackoff: 200 * time.Millisecond, Metrics: metrics.New()})
	r.run(rl)
	tu.Eventually(t, 30*time.Second, func() bool { return scalar(t, r.st, pgtest.PendingEventsSQL("")) == 0 }, "every event relayed")
	if n := rl.PeakDrains(); n < 1 || n > 2 {
		t.Fatalf("%d topics drained at once, want at most 2", n)
	}
}

// A key's events left pending behind its first (a batch takes one per
// key) are read again, whatever other keys' events the batch sent after
// them: the relay's cursor never passes a pending event, and a key's
// events leave in the order they were written.
func TestRelayCursorKeepsAKeysLaterEvents(t *testing.T) {
	t.Parallel()
	r := newEventRig(t, map[string]string{"t": "ev"}, "ev")
	write := func(key string, n int) {
		t.Helper()
		if _, err := r.st.Pool().Exec(ctx, `INSERT INTO hipq_event (queue, topic, job_id, job_type, job_key, attempt, outcome, value)
			SELECT 'default', 'ev', 1, 't', $1, a, 'retry', '{}' FROM generate_series(1, $2) AS a`, key, n); err != nil {
			t.Fatal(err)
		}
	}
	rl := r.relay(metrics.New())
	write("k1", 3)
	if n, _, err := rl.RelayTopic(ctx, "ev"); err != nil || n != 1 {
		t.Fatalf("first batch: %d sent, %v; want k1's first", n, err)
	}
	write("k2", 1) // (after k1's pending two: the next batch sends k1's second and k2's)
	for range 4 {
		if _, _, err := rl.RelayTopic(ctx, "ev"); err != nil {
			t.Fatal(err)
		}
	}
	if n := scalar(t, r.st, "SELECT count(*) FROM hipq_event"); n != 0 {
		t.Fatalf("%d events left pending (cursor past them)", n)
	}
	rd := r.reader("ev")
	rd.until("the 4 events", func(recs []*kgo.Record) bool { return len(recs) >= 4 })
	var k1 []string
	for _, rec := range rd.recs {
		if string(rec.Key) == "k1" {
			k1 = append(k1, header(rec, correlator.HeaderAttempt))
		}
	}
	if !slices.Equal(k1, []string{"1", "2", "3"}) {
		t.Errorf("k1's events arrived as attempts %v, want 1, 2, 3", k1)
	}
}

// keyEndsTwice ends job 1 of key k0 (its final event on the job), relays
// it, then ends job 2 of the key as ok says (a retry: a row; a success: a
// final event on the job) and checks that the next look holds job 2's
// event back. It returns the rig and the relay that sent job 1's.
func keyEndsTwice(t *testing.T, ok bool) (*eventRig, *dispatcher.Relay) {
	t.Helper()
	r, rl := relayedEnds(t, "k", 1)
	r.insert("t", "k", 1)
	r.answer(ok)
	if n, _, err := rl.RelayTopic(ctx, "ev"); err != nil || n != 0 {
		t.Fatalf("second look: %d sent, %v; want job 2's event held back", n, err)
	}
	return r, rl
}

// A key's row event never leaves while a final event of the key read from
// its job was sent above the cursor kept: a relay after a crash would send
// that final event again, after the row. The row waits one look, in which
// the relay strikes the sent final event from its job; then it leaves, and
// the next relay sends nothing of the key again.
func TestRelayHoldsAKeysRowBehindItsFinalEventOnAJob(t *testing.T) {
	pgtest.SkipOnCitus(t, "there every event is a row, deleted once relayed")
	t.Parallel()
	r, rl := keyEndsTwice(t, false) // (job 2's retry: a row)
	if n := scalar(t, r.st, "SELECT count(*) FROM hipq_job WHERE job_key = 'k0' AND event_id IS NOT NULL"); n != 0 {
		t.Fatalf("%d jobs keep a sent final event, want it struck", n)
	}
	if n, _, err := rl.RelayTopic(ctx, "ev"); err != nil || n != 1 {
		t.Fatalf("third look: %d sent, %v; want the row", n, err)
	}
	// A relay after a crash sends nothing of the key again.
	if n, _, err := r.relay(metrics.New()).RelayTopic(ctx, "ev"); err != nil || n != 0 {
		t.Fatalf("the next relay: %d sent, %v", n, err)
	}
	rd := r.reader("ev")
	rd.until("both events", func(rs []*kgo.Record) bool { return len(rs) >= 2 })
	if got := outcomes(rd.recs); !slices.Equal(got, []string{"succeeded", "retry"}) {
		t.Errorf("k0's events %v, want job 1's final, then job 2's retry", got)
	}
}

// The same for a key's next final event read from its job: it waits until
// the key's earlier one is struck, so a relay after a crash sends neither
// again out of order.
func TestRelayHoldsAKeysNextFinalEventOnAJob(t *testing.T) {
	pgtest.SkipOnCitus(t, "there every event is a row, deleted once relayed")
	t.Parallel()
	r, rl := keyEndsTwice(t, true)
	if n, _, err := rl.RelayTopic(ctx, "ev"); err != nil || n != 1 {
		t.Fatalf("third look: %d sent, %v; want job 2's final event", n, err)
	}
	next := r.relay(metrics.New())
	for range 3 {
		if _, _, err := next.RelayTopic(ctx, "ev"); err != nil {
			t.Fatal(err)
		}
	}
	rd := r.reader("ev")
	rd.until("the events", func(rs []*kgo.Record) bool { return len(rs) >= 2 })
	var jobs []string
	for _, rec := range rd.recs {
		jobs = append(jobs, header(rec, correlator.HeaderJobID))
	}
	if len(jobs) < 2 || jobs[0] == jobs[1] || slices.Contains(jobs[2:], jobs[0]) {
		t.Errorf("events of jobs %v: job 1's event sent again after job 2's", jobs)
	}
}

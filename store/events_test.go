package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/schemas"
	"github.com/hipq/hipq/store"
)

// eventTypes: "t" (three attempts) and "once" (one) publish on "ev", with
// each retry too; "quiet" publishes nothing; every type allows reply_to
// topics "rep.*".
func eventTypes() correlator.Types {
	ts := correlator.Types{}
	for name, jt := range types {
		cp := *jt
		ts[name] = &cp
	}
	ts["once"] = &correlator.JobType{Name: "once", Queue: "default", Timeout: time.Hour, Priority: 100, ThrottleFactor: 1,
		Delivery: correlator.AtMostOnce, Retry: correlator.NoRetry}
	ts["quiet"] = &correlator.JobType{Name: "quiet", Queue: "default", Timeout: time.Hour, Priority: 100, ThrottleFactor: 1,
		Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry}
	for name, jt := range ts {
		if name != "quiet" {
			jt.Events = correlator.Events{Topic: "ev", Attempts: true}
		}
		jt.AllowedReplyTo = []string{"rep.*"}
	}
	return ts
}

// eventValue is an event's value as a consumer reads it.
type eventValue struct {
	JobType    string          `json:"job_type"`
	JobKey     string          `json:"job_key"`
	JobID      int64           `json:"job_id"`
	Attempt    int             `json:"attempt"`
	State      string          `json:"state"`
	Outcome    string          `json:"outcome"`
	Result     json.RawMessage `json:"result"`
	Error      *string         `json:"error"`
	CreatedAt  time.Time       `json:"created_at"`
	FinishedAt time.Time       `json:"finished_at"`
}

// pendingEvents reads every pending event of topic, by job key.
func pendingEvents(t *testing.T, st *store.Store, topic string) map[string][]store.Event {
	t.Helper()
	evs, err := st.EventRead(ctx, topic, 1000)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]store.Event{}
	for _, e := range evs {
		out[e.JobKey] = append(out[e.JobKey], e)
	}
	return out
}

// TestEveryEndWritesItsEvent: each way a job ends (a reply, a sync reply
// and an early reply, a timeout, a dispatch error, a rescue ending an
// at_most_once claim, expiry by the sweeper and at a window deferral, a
// cancel) writes one event on its type's topic, in the transaction that
// ends it, with its outcome, attempt and value; an attempt ending in a
// retry writes one of outcome retry; a job's own reply_to gets its final
// event, with the correlation headers it came with; a type without events
// writes none.
func TestEveryEndWritesItsEvent(t *testing.T) {
	t.Parallel()
	tys := eventTypes()
	st := pgtest.New(t).WithEvents(store.EventsOf(tys))
	once := func(j *correlator.Job) { j.JobType, j.MaxAttempts = "once", 1 }
	past := time.Now().Add(-time.Minute)
	closed := []correlator.TimeWindow{{Start: "00:00", End: "00:01", TZ: "UTC"}}
	insert(t, st,
		job("ok", func(j *correlator.Job) {
			j.ReplyTo = "rep.a"
			j.Correlation = []correlator.Header{{Key: "hipq-correlation-id", Value: []byte("c-1")}}
			j.Trace.Parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
		}),
		job("retry"), job("timeout", once), job("dispatch", once), job("sync"), job("rescue", once), job("cancel"),
		job("quiet", func(j *correlator.Job) { j.JobType = "quiet"; j.MaxAttempts = 1 }),
		job("early"),
	)
	c := claim(t, st, 100)
	byKey := map[string]*store.Claimed{}
	for i := range c {
		byKey[c[i].JobKey] = &c[i]
	}
	// A job that expires waiting, and one found past its expiry outside its
	// windows, come after the claim.
	insert(t, st, job("expire", func(j *correlator.Job) { j.ExpiresAt = &past }),
		job("defer", func(j *correlator.Job) { j.TimeWindows = closed }))

	// Replies: success (to the job with a reply_to), failure (a retry), and
	// a reply to the type without events.
	quiet := reply("quiet", 1, true)
	quiet.Reply.JobType = "quiet"
	if _, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{reply("ok", 1, true), reply("retry", 1, false), quiet},
		EarlyTTL: time.Minute}, tys); err != nil {
		t.Fatal(err)
	}
	// A delivery: a dispatch error, and a sync reply.
	run := func(j *store.Claimed) correlator.Running {
		return correlator.Running{Attempt: j.Attempt, MaxAttempts: j.MaxAttempts}
	}
	d := byKey["dispatch"]
	syncReply := reply("sync", 1, true)
	if _, err := st.DeliveryRecord(ctx, store.Delivery{
		Sent: []store.AttemptRef{byKey["sync"].Ref()},
		Resolves: []store.Resolve{{Queue: d.Queue, JobID: d.ID, Attempt: d.Attempt, Claim: d.StartedAt,
			Res: correlator.DispatchFailed(tys["once"], run(d), "HTTP 500", true, correlator.RetryAfter{}, time.Now())}},
		Replies: []store.ReplyIn{syncReply},
	}, tys); err != nil {
		t.Fatal(err)
	}
	// A timeout (its send recorded, its deadline past).
	if err := st.AttemptMarkSent(ctx, []store.AttemptRef{byKey["timeout"].Ref()}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET started_at = now() - interval '2 hours' WHERE job_key = 'timeout'`); err != nil {
		t.Fatal(err)
	}
	if done, err := st.JobTimeOutStuck(ctx, 100, tys); err != nil || len(done) != 1 {
		t.Fatalf("timed out %v, %v", done, err)
	}
	// The rescue ending an at_most_once claim never known to be sent.
	r := byKey["rescue"]
	_, unknown := correlator.SendUnknown(tys["once"], "claimed but not known to be sent")
	if done, err := st.JobFailUnsent(ctx, []store.Resolve{{Queue: r.Queue, JobID: r.ID, Attempt: r.Attempt, Claim: r.StartedAt, Res: unknown}}); err != nil || len(done) != 1 {
		t.Fatalf("rescue ended %v, %v", done, err)
	}
	// An early reply kept, then applied by the sweep.
	if _, err := st.Pool().Exec(ctx, `INSERT INTO hipq_early_reply (queue, job_type, job_key, attempt, success, retryable, reply, topic, expires_at)
		VALUES ('default', 't', 'early', 1, true, true, '{"status": "succeeded"}', 'replies', now() + interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.EarlyReplySweep(ctx, 0, 100, tys); err != nil {
		t.Fatal(err)
	}
	// Expiry by the sweeper, and at a deferral.
	if n, err := st.JobExpire(ctx, 100); err != nil || n != 1 {
		t.Fatalf("expired %d, %v", n, err)
	}
	def := get(t, st, "defer")
	if n, err := st.JobDefer(ctx, []store.Deferral{{Queue: def.Queue, ID: def.ID, State: def.State, Attempt: def.Attempt, Expire: true}}); err != nil || n != 1 {
		t.Fatalf("deferred %d, %v", n, err)
	}
	// A cancel.
	if _, err := st.JobCancel(ctx, "t", "cancel"); err != nil {
		t.Fatal(err)
	}

	evs := pendingEvents(t, st, "ev")
	want := map[string][]string{ // outcomes in order
		"ok": {"succeeded"}, "retry": {"retry"}, "timeout": {"timed_out"}, "dispatch": {"failed"}, "sync": {"succeeded"},
		"rescue": {"failed"}, "early": {"succeeded"}, "expire": {"expired"}, "defer": {"expired"}, "cancel": {"cancelled"},
	}
	for key, outcomes := range want {
		got := evs[key]
		if len(got) != len(outcomes) {
			t.Errorf("%s: %d events, want %d", key, len(got), len(outcomes))
			continue
		}
		for i, e := range got {
			j, err := st.JobGet(ctx, e.JobType, key)
			if err != nil {
				t.Fatalf("%s: %v", key, err)
			}
			var v eventValue
			if err := json.Unmarshal(e.Value, &v); err != nil {
				t.Fatalf("%s: value %s: %v", key, e.Value, err)
			}
			if e.Outcome != outcomes[i] || v.Outcome != outcomes[i] || e.JobID != j.ID || v.JobID != j.ID || v.JobKey != key ||
				v.JobType != j.JobType || e.JobType != j.JobType || v.Attempt != j.Attempt || e.Attempt != j.Attempt ||
				v.State != string(j.State) || v.CreatedAt.IsZero() || v.FinishedAt.Before(v.CreatedAt) {
				t.Errorf("%s: event %+v value %s, want outcome %s of job %d (%s, attempt %d)", key, e, e.Value, outcomes[i], j.ID, j.State, j.Attempt)
			}
			if (v.Error == nil) != (outcomes[i] == "succeeded") {
				t.Errorf("%s: error %v with outcome %s", key, v.Error, outcomes[i])
			}
		}
	}
	if len(evs) != len(want) {
		t.Errorf("events for %d jobs, want %d: %v", len(evs), len(want), evs)
	}
	// The value holds exactly the fields its schema requires.
	b, err := fs.ReadFile(schemas.JSON, "json/event.schema.json")
	if err != nil {
		t.Fatal(err)
	}
	var schema struct {
		Required []string `json:"required"`
	}
	if err := json.Unmarshal(b, &schema); err != nil {
		t.Fatal(err)
	}
	var fields map[string]json.RawMessage
	_ = json.Unmarshal(evs["retry"][0].Value, &fields)
	if got := slices.Sorted(maps.Keys(fields)); !slices.Equal(got, slices.Sorted(slices.Values(schema.Required))) {
		t.Errorf("value fields %v, the schema requires %v", got, schema.Required)
	}
	var ok eventValue
	_ = json.Unmarshal(evs["ok"][0].Value, &ok)
	if string(ok.Result) != `{"r": 1}` {
		t.Errorf("result %s, want the reply's", ok.Result)
	}
	if e := evs["ok"][0]; e.TraceParent == "" || len(e.Headers) != 1 || e.Headers[0].Key != "hipq-correlation-id" || string(e.Headers[0].Value) != "c-1" {
		t.Errorf("ok: trace %q headers %v, want its traceparent and correlation id", e.TraceParent, e.Headers)
	}
	rep := pendingEvents(t, st, "rep.a")
	if len(rep) != 1 || len(rep["ok"]) != 1 || rep["ok"][0].Outcome != "succeeded" || len(rep["ok"][0].Headers) != 1 {
		t.Errorf("reply_to events %v, want the final one of ok, with its headers", rep)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_event WHERE job_type = 'quiet'"); n != 0 {
		t.Errorf("%d events of a type without events", n)
	}
	// On one PostgreSQL the ends in the resolve's statement leave their
	// final event on the job; the others write rows.
	if !pgtest.OnCitus() {
		for key, onJob := range map[string]bool{"ok": true, "sync": true, "timeout": true, "dispatch": true, "rescue": true, "early": true,
			"retry": false, "expire": false, "defer": false, "cancel": false} {
			if e := evs[key][0]; e.OnJob != onJob {
				t.Errorf("%s: event read from its job %v, want %v", key, e.OnJob, onJob)
			}
		}
		if rep["ok"][0].OnJob {
			t.Error("the reply_to event read from the job, want a row")
		}
	}
}

// endJobs makes n jobs of type t (keys prefix-0…) and ends them with
// successful replies: on one PostgreSQL their final events are read from
// the jobs.
func endJobs(t *testing.T, st *store.Store, tys correlator.Types, prefix string, n int) {
	t.Helper()
	var rs []store.ReplyIn
	for i := range n {
		key := fmt.Sprintf("%s-%d", prefix, i)
		insert(t, st, job(key))
		rs = append(rs, reply(key, 1, true))
	}
	claim(t, st, n)
	if _, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: rs}, tys); err != nil {
		t.Fatal(err)
	}
}

// idle looks at ev until the relay's cursor, kept in hipq_event_cursor,
// is at want: an idle relay passes what it sent at its next looks, once
// every transaction open in the cluster when it sent them has ended (the
// package's other tests run theirs beside).
func idle(t *testing.T, st *store.Store, c *store.EventCursor, want int64) {
	t.Helper()
	testutil.Eventually(t, time.Minute, func() (bool, string) {
		if evs := relayFrom(t, st, c); len(evs) != 0 {
			t.Fatalf("an idle look read %v", evs)
		}
		kept := count(t, st, `SELECT coalesce(max(after), 0) FROM hipq_event_cursor WHERE topic = 'ev'`)
		return kept >= int(want), fmt.Sprintf("cursor kept at %d", kept)
	}, "the cursor kept at %d", want)
}

// TestEventCursorKeptAcrossRelays: the final events read from jobs are not
// deleted; the relay keeps how far it went in hipq_event_cursor, so the
// next relay (another instance, or this one restarted) starts there and
// sends none again; retention keeps a job until its event is passed.
func TestEventCursorKeptAcrossRelays(t *testing.T) {
	pgtest.SkipOnCitus(t, "there every event is a row of hipq_event, deleted once relayed")
	t.Parallel()
	tys := eventTypes()
	st := pgtest.New(t).WithEvents(store.EventsOf(tys))
	endJobs(t, st, tys, "a", 3)
	if n := count(t, st, "SELECT count(*) FROM hipq_event"); n != 0 {
		t.Fatalf("%d rows of hipq_event for final events read from the jobs", n)
	}
	if n := count(t, st, pgtest.PendingEventsSQL("ev")); n != 3 {
		t.Fatalf("%d events pending, want 3", n)
	}
	if n, err := st.JobPrune(ctx, 0, 100); err != nil || n != 0 {
		t.Fatalf("pruned %d (%v) jobs whose events wait, want none", n, err)
	}
	topics, err := st.EventTopics(ctx)
	if err != nil || !slices.Equal(topics, []string{"ev"}) {
		t.Fatalf("topics with events %v (%v), want ev", topics, err)
	}
	pending, err := st.EventsPending(ctx)
	if err != nil || pending["ev"] != 3 {
		t.Fatalf("pending %v (%v), want 3 on ev", pending, err)
	}

	c, err := st.EventCursorOf(ctx, "ev")
	if err != nil {
		t.Fatal(err)
	}
	evs := relayFrom(t, st, c)
	if len(evs) != 3 {
		t.Fatalf("relayed %d events, want 3", len(evs))
	}
	idle(t, st, c, evs[2].ID)
	if n := count(t, st, pgtest.PendingEventsSQL("ev")); n != 0 {
		t.Fatalf("%d events pending once relayed", n)
	}
	pending, err = st.EventsPending(ctx)
	if err != nil || len(pending) != 0 {
		t.Fatalf("pending %v (%v), want none", pending, err)
	}

	// The next relay starts where this one was, and reads what came since.
	endJobs(t, st, tys, "b", 2)
	next, err := st.EventCursorOf(ctx, "ev")
	if err != nil {
		t.Fatal(err)
	}
	if next.After() < evs[2].ID {
		t.Fatalf("the next relay starts above %d, want at least %d", next.After(), evs[2].ID)
	}
	if got := relayFrom(t, st, next); len(got) != 2 || got[0].JobKey != "b-0" || got[1].JobKey != "b-1" {
		t.Fatalf("the next relay read %v, want b-0 and b-1 only", got)
	}
	if n, err := st.JobPrune(ctx, 0, 100); err != nil || n != 3 {
		t.Fatalf("pruned %d (%v), want the 3 jobs whose events were passed", n, err)
	}
}

// TestEventsOfBothKindsLeaveInOrder: rows of hipq_event (attempt events,
// those of the other ends, and those an older version wrote) and final
// events read from jobs share one sequence, and a read returns them
// merged in its order.
func TestEventsOfBothKindsLeaveInOrder(t *testing.T) {
	pgtest.SkipOnCitus(t, "there every event is a row of hipq_event")
	t.Parallel()
	tys := eventTypes()
	st := pgtest.New(t).WithEvents(store.EventsOf(tys))
	before := insertEvent(t, st.Pool(), "row-before")
	endJobs(t, st, tys, "job", 2)
	after := insertEvent(t, st.Pool(), "row-after")
	c, err := st.EventCursorOf(ctx, "ev")
	if err != nil {
		t.Fatal(err)
	}
	evs := relayFrom(t, st, c)
	var keys []string
	for i, e := range evs {
		keys = append(keys, e.JobKey)
		if i > 0 && e.ID <= evs[i-1].ID {
			t.Errorf("ids out of order: %v", evs)
		}
	}
	if !slices.Equal(keys, []string{"row-before", "job-0", "job-1", "row-after"}) || evs[0].ID != before || evs[3].ID != after || !evs[1].OnJob || evs[0].OnJob {
		t.Fatalf("read %v, want the row, the two jobs' events, the row", evs)
	}
	idle(t, st, c, after)
	if n := count(t, st, pgtest.PendingEventsSQL("")); n != 0 {
		t.Fatalf("%d events pending", n)
	}
}

// TestNoEventsWhenOff: a store without events writes none, whatever the
// job asked (a reply_to stored by an instance that allowed one).
func TestNoEventsWhenOff(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a", func(j *correlator.Job) { j.ReplyTo = "rep.a" }))
	claim(t, st, 1)
	applyReplies(t, st, reply("a", 1, true))
	if n := count(t, st, "SELECT count(*) FROM hipq_event"); n != 0 {
		t.Errorf("%d events written with events off", n)
	}
	if j := get(t, st, "a"); j.ReplyTo != "rep.a" {
		t.Errorf("reply_to %q, want it stored", j.ReplyTo)
	}
}

// TestEventsCommitWithTheirEnd: an event is there exactly when its job's
// end is committed: a reply batch rolled back (its offsets moved under it)
// leaves neither.
func TestEventsCommitWithTheirEnd(t *testing.T) {
	t.Parallel()
	tys := eventTypes()
	st := pgtest.New(t).WithEvents(store.EventsOf(tys))
	insert(t, st, job("a"))
	claim(t, st, 1)
	_, err := st.ReplyApply(ctx, store.ReplyBatch{Group: "g", Offsets: []store.OffsetAdvance{{Topic: "replies", Partition: 0, From: 5, To: 6}},
		Replies: []store.ReplyIn{reply("a", 1, true)}}, tys)
	if !errors.Is(err, store.ErrOffsetConflict) {
		t.Fatalf("got %v, want the offset conflict", err)
	}
	if n := count(t, st, pgtest.PendingEventsSQL("")); n != 0 {
		t.Errorf("%d events of an end rolled back", n)
	}
	wantState(t, get(t, st, "a"), correlator.StateRunning, "", 1)
}

// TestRelayReadNeverSkipsALateCommit: events are deleted once relayed,
// never passed by a mark, so one committed after an event of a higher id
// was read (its transaction began first, and was slow) is read at the next
// look, and per key the ids follow the commits.
func TestRelayReadNeverSkipsALateCommit(t *testing.T) {
	t.Parallel()
	tys := eventTypes()
	st := pgtest.New(t).WithEvents(store.EventsOf(tys))
	insert(t, st, job("slow"), job("fast"))
	cs := claim(t, st, 2)
	ref := map[string]store.AttemptRef{}
	for i := range cs {
		ref[cs[i].JobKey] = cs[i].Ref()
	}
	ends := func(key string) []store.Resolve {
		return []store.Resolve{{Queue: ref[key].Queue, JobID: ref[key].JobID, Attempt: 1,
			Res: correlator.Replied(tys["t"], correlator.Running{Attempt: 1, MaxAttempts: 3}, &correlator.Reply{Success: true}, time.Now())}}
	}
	// The slow end takes its event id first and commits last.
	tx, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }() // (committed below)
	var slowID int64
	if err := tx.QueryRow(ctx, `INSERT INTO hipq_event (queue, topic, job_id, job_type, job_key, attempt, outcome, value)
		VALUES ('default', 'ev', $1, 't', 'slow', 1, 'succeeded', '{}') RETURNING id`, ref["slow"].JobID).Scan(&slowID); err != nil {
		t.Fatal(err)
	}
	if _, err := st.JobResolveMany(ctx, ends("fast")); err != nil {
		t.Fatal(err)
	}
	c, err := st.EventCursorOf(ctx, "ev")
	if err != nil {
		t.Fatal(err)
	}
	first, err := st.EventReadFrom(ctx, "ev", c, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(first) != 1 || first[0].JobKey != "fast" || first[0].ID < slowID || first[0].OnJob == pgtest.OnCitus() {
		t.Fatalf("read %v, want only fast's event, read from its job, of an id above %d", first, slowID)
	}
	if err := st.EventDeleteFrom(ctx, c, []store.EventRef{first[0].Ref()}, 0); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	next, err := st.EventReadFrom(ctx, "ev", c, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(next) != 1 || next[0].ID != slowID {
		t.Fatalf("after the late commit read %v, want the event %d (and not fast's again)", next, slowID)
	}
}

// TestOneRelayHoldsTheLock: the relay's lock is held by one lease at a
// time, and is free again once released.
func TestOneRelayHoldsTheLock(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var mu sync.Mutex
	held := 0
	var leases []*store.Lease
	for range 3 {
		l, ok, err := st.EventRelayLock(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			mu.Lock()
			held++
			leases = append(leases, l)
			mu.Unlock()
		}
	}
	if held != 1 {
		t.Fatalf("%d leases held at once, want 1", held)
	}
	if err := leases[0].Alive(ctx); err != nil {
		t.Fatal(err)
	}
	leases[0].Release()
	l, ok, err := st.EventRelayLock(ctx)
	if err != nil || !ok {
		t.Fatalf("lock after release: %v %v", ok, err)
	}
	l.Release()
}

// The relay's and the sweeper's locks are per schema: the hipq of another
// schema in the same database relays and sweeps its own while this one's
// are held.
func TestRelayAndSweeperLocksArePerSchema(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	open := func(schema string) *store.Store {
		st, err := store.Open(ctx, store.Config{URL: url, Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(st.Close)
		if _, err := st.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		return st
	}
	a, b := open("hipq_a"), open("hipq_b")
	la, ok, err := a.EventRelayLock(ctx)
	if err != nil || !ok {
		t.Fatalf("relay lock of a: %v %v", ok, err)
	}
	defer la.Release()
	lb, ok, err := b.EventRelayLock(ctx)
	if err != nil || !ok {
		t.Fatalf("relay lock of b while a's is held: %v %v", ok, err)
	}
	defer lb.Release()
	if _, ok, err := a.EventRelayLock(ctx); err != nil || ok {
		t.Fatalf("a second relay lock of a: %v %v, want refused", ok, err)
	}
	ra, ok, err := a.SweeperLock(ctx)
	if err != nil || !ok {
		t.Fatalf("sweeper lock of a: %v %v", ok, err)
	}
	defer ra()
	rb, ok, err := b.SweeperLock(ctx)
	if err != nil || !ok {
		t.Fatalf("sweeper lock of b while a's is held: %v %v", ok, err)
	}
	rb()
}

// TestCancelWakesTheRelay: the event a cancel writes wakes the relay at
// commit, on one PostgreSQL (hipq_event's trigger) and on Citus (where
// the trigger is dropped and the cancel notifies itself).
func TestCancelWakesTheRelay(t *testing.T) {
	st := pgtest.New(t).WithEvents(store.EventsOf(eventTypes()))
	insert(t, st, job("c"))
	wakes := waitEvents(t, st)
	select {
	case topics := <-wakes: // (WaitEvents wakes once as it starts listening: for every topic)
		if topics != nil {
			t.Errorf("the first wake names %v, want every topic (nil)", topics)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the relay's wait never listened")
	}
	if _, err := st.JobCancel(ctx, "t", "c"); err != nil {
		t.Fatal(err)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_event"); n != 1 {
		t.Fatalf("%d events, want the cancel's", n)
	}
	select {
	case topics := <-wakes:
		// One PostgreSQL's trigger names the topics written to; Citus's
		// own notice names none (every topic).
		if want := []string{"ev"}; st.Distributed() && topics != nil || !st.Distributed() && !slices.Equal(topics, want) {
			t.Errorf("the cancel's notice names %v, want %v", topics, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the cancel's event woke no relay")
	}
}

// TestEventNoticeNamesItsTopics: a statement that writes events to
// several topics names each once in its notice; one whose names would not
// fit a notice names none (the relay then looks at every topic).
func TestEventNoticeNamesItsTopics(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	if st.Distributed() {
		t.Skip("on Citus the statements notify themselves, naming no topic")
	}
	wakes := waitEvents(t, st)
	next := func() []string {
		t.Helper()
		select {
		case topics := <-wakes:
			return topics
		case <-time.After(10 * time.Second):
			t.Fatal("no notice")
			return nil
		}
	}
	next() // (as it starts listening)
	write := func(topics ...string) {
		t.Helper()
		if _, err := st.Pool().Exec(ctx, `INSERT INTO hipq_event (queue, topic, job_id, job_type, job_key, attempt, outcome, value)
			SELECT 'default', t, 1, 't', 'k', 1, 'succeeded', '{}' FROM unnest($1::text[]) AS t`, topics); err != nil {
			t.Fatal(err)
		}
	}
	write("b.two", "a.one", "b.two", "a.one")
	if got := next(); !slices.Equal(got, []string{"a.one", "b.two"}) {
		t.Errorf("notice names %v, want a.one and b.two", got)
	}
	var many []string
	for i := range 60 {
		many = append(many, fmt.Sprintf("reply.%03d.%s", i, strings.Repeat("x", 200)))
	}
	write(many...)
	if got := next(); got != nil {
		t.Errorf("a notice for %d long topic names names %d, want none (every topic)", len(many), len(got))
	}
}

// TestEventCursorNeverPassesALateCommit: a relay's reads start after the
// events it relayed, but never after an event that may still commit: one
// whose id was taken by a transaction still open when a higher one was
// read and deleted is read once it commits. Once every transaction that
// could hold a lower id has ended, the cursor passes the relayed ids (the
// next read starts above them).
func TestEventCursorNeverPassesALateCommit(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	if st.Distributed() {
		t.Skip("on Citus the relay reads by write order, with no cursor")
	}
	ins := func(q rowQuerier, key string) int64 { t.Helper(); return insertEvent(t, q, key) }
	relay := func(c *store.EventCursor) []store.Event { t.Helper(); return relayFrom(t, st, c) }
	var c store.EventCursor
	tx, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }() // (committed below)
	slow := ins(tx, "slow")
	fast := ins(st.Pool(), "fast")
	for range 3 { // (reads while the slow one is open: none may pass it)
		for _, e := range relay(&c) {
			if e.ID == slow {
				t.Fatalf("read the event %d of a transaction still open", slow)
			}
		}
		if c.After() >= slow {
			t.Fatalf("the cursor passed %d to %d while %d may still commit", fast, c.After(), slow)
		}
		ins(st.Pool(), "more")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	evs := relay(&c)
	if len(evs) == 0 || evs[0].ID != slow {
		t.Fatalf("after the late commit read %v, want the event %d first", evs, slow)
	}
	// Nothing open now: the next reads settle what was relayed.
	// (The cluster's other tests' transactions may hold the snapshots'
	// xmin back a while: the reads go on until it passes.)
	last := ins(st.Pool(), "last")
	for deadline := time.Now().Add(30 * time.Second); c.After() < last; {
		if time.Now().After(deadline) {
			t.Fatalf("the cursor stays at %d, below %d, with every event up to it relayed and no transaction of the test open", c.After(), last)
		}
		relay(&c)
		ins(st.Pool(), "next")
	}
	if evs := relay(&c); len(evs) != 1 || evs[0].JobKey != "next" {
		t.Errorf("read %v after the cursor moved, want the last event written", evs)
	}
}

// TestEventCursorWaitsForOlderTransactions: a transaction that took its
// transaction id before another's and its event id after (so its id lies
// below an event the relay read, while its transaction id is not below
// any that had ended) is waited for: the cursor does not pass its event's
// id until it ends, however the reads' snapshots look meanwhile.
func TestEventCursorWaitsForOlderTransactions(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	if st.Distributed() {
		t.Skip("on Citus the relay reads by write order, with no cursor")
	}
	begin := func() pgx.Tx {
		t.Helper()
		tx, err := st.Pool().Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		if _, err := tx.Exec(ctx, `SELECT pg_current_xact_id()`); err != nil { // (its transaction id, now)
			t.Fatal(err)
		}
		return tx
	}
	ins := func(q rowQuerier, key string) int64 { t.Helper(); return insertEvent(t, q, key) }
	var c store.EventCursor
	relay := func() []store.Event { t.Helper(); return relayFrom(t, st, &c) }
	first, second := begin(), begin() // (first's transaction id is the lower)
	held := ins(second, "held")       // the older event id, in the younger transaction...
	ins(first, "first")               // ...and the younger id in the older one, which ends first
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for range 4 {
		for _, e := range relay() {
			if e.JobKey == "held" {
				t.Fatal("read the event of a transaction still open")
			}
		}
		ins(st.Pool(), "more")
		if c.After() >= held {
			t.Fatalf("the cursor passed %d while its transaction was open", held)
		}
	}
	if err := second.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if evs := relay(); len(evs) == 0 || evs[0].ID != held {
		t.Fatalf("read %v once it committed, want %d first", evs, held)
	}
}

// rowQuerier is a pool or a transaction.
type rowQuerier interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}

// insertEvent writes an event of key on topic ev through q and returns
// its id.
func insertEvent(t *testing.T, q rowQuerier, key string) int64 {
	t.Helper()
	var id int64
	if err := q.QueryRow(ctx, `INSERT INTO hipq_event (queue, topic, job_id, job_type, job_key, attempt, outcome, value)
		VALUES ('default', 'ev', 1, 't', $1, 1, 'succeeded', '{}') RETURNING id`, key).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// relayFrom relays ev's events from the cursor c as the relay does, but
// for the produce: read, delete every event read, move the cursor.
func relayFrom(t *testing.T, st *store.Store, c *store.EventCursor) []store.Event {
	t.Helper()
	evs, err := st.EventReadFrom(ctx, "ev", c, 100)
	if err != nil {
		t.Fatal(err)
	}
	refs := make([]store.EventRef, len(evs))
	for i := range evs {
		refs[i] = evs[i].Ref()
	}
	if err := st.EventDeleteFrom(ctx, c, refs, 0); err != nil {
		t.Fatal(err)
	}
	return evs
}

// waitEvents listens for st's event notices while the test lasts: each
// wake's topics arrive on the channel returned.
func waitEvents(t *testing.T, st *store.Store) <-chan []string {
	cctx, cancel := context.WithCancel(ctx)
	wakes := make(chan []string, 16)
	listening := make(chan struct{})
	go func() {
		defer close(listening)
		st.WaitEvents(cctx, func(topics []string) { wakes <- topics }, func(error) {})
	}()
	t.Cleanup(func() { cancel(); <-listening })
	return wakes
}

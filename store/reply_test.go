package store_test

import (
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
	"github.com/hipq/hipq/store"
)

// TestReplyTable applies one reply per row of the SPEC §6 table to real rows.
func TestReplyTable(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("ok"), job("fail"), job("fatal"), job("old"), job("newer"), job("waiting"))
	claim(t, st, 5) // "waiting" is the sixth in order and stays initial
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_job SET state = 'initial', attempt = 0 WHERE job_key = 'waiting'"); err != nil {
		t.Fatal(err)
	}
	fatal := reply("fatal", 1, false)
	fatal.Reply.Retryable = false
	unknown := reply("x", 1, true)
	unknown.Reply.JobType = "nope"
	res := applyReplies(t, st,
		reply("ok", 1, true),      // running, success → final/succeeded
		reply("fail", 1, false),   // running, failure → retry policy
		fatal,                     // failure, retryable false → final/failed
		reply("old", 0, true),     // attempt absent → applies
		reply("newer", 2, true),   // attempt newer than the job's → dead letter
		reply("nojob", 0, true),   // no row at all → early
		reply("waiting", 1, true), // initial, attempt 1 → early
		unknown,                   // unknown job type → dead letter
	)
	want := []correlator.Verdict{correlator.Apply, correlator.Apply, correlator.Apply, correlator.Apply,
		correlator.DeadLetter, correlator.Early, correlator.Early, correlator.DeadLetter}
	for i, v := range res.Verdicts {
		if v != want[i] {
			t.Errorf("reply %d: %v, want %v", i, v, want[i])
		}
	}
	ok := get(t, st, "ok")
	wantState(t, ok, correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	if string(ok.Result) != `{"r": 1}` || ok.Error != correlator.ErrorNone {
		t.Errorf("result %s error %q", ok.Result, ok.Error)
	}
	fail := get(t, st, "fail")
	wantState(t, fail, correlator.StateRetry, "", 1)
	if fail.Error != "nope" || fail.ScheduledRunTime.Before(time.Now().Add(50*time.Second)) {
		t.Errorf("retry: error %q next %v", fail.Error, fail.ScheduledRunTime)
	}
	wantState(t, get(t, st, "fatal"), correlator.StateFinal, correlator.OutcomeFailed, 1)
	wantState(t, get(t, st, "newer"), correlator.StateRunning, "", 1)
	if n := count(t, st, "SELECT count(*) FROM hipq_early_reply"); n != 2 {
		t.Errorf("%d early replies kept, want 2", n)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_dead_letter WHERE source = 'reply'"); n != 2 {
		t.Errorf("%d dead letters, want 2", n)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_attempt WHERE outcome = 'succeeded' AND replied_at IS NOT NULL AND reply IS NOT NULL"); n != 2 {
		t.Errorf("%d attempts record their reply, want 2", n)
	}

	// Now the stale and duplicate rows: a reply for the resolved attempt of
	// a job in retry, for a final job, and an older attempt.
	res = applyReplies(t, st, reply("fail", 1, true), reply("ok", 1, true), reply("ok", 0, false))
	for i, v := range []correlator.Verdict{correlator.Stale, correlator.Duplicate, correlator.Duplicate} {
		if res.Verdicts[i] != v {
			t.Errorf("second batch reply %d: %v, want %v", i, res.Verdicts[i], v)
		}
	}
	wantState(t, get(t, st, "fail"), correlator.StateRetry, "", 1)
	wantState(t, get(t, st, "ok"), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
}

// Key reuse: a late reply fenced by an old job id never touches the newer
// job with the same key.
func TestLateReplyNeverTouchesNewerJobWithSameKey(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("k"))
	old := claim(t, st, 1)[0]
	applyReplies(t, st, reply("k", 1, true))
	insert(t, st, job("k"))
	newer := claim(t, st, 1)[0]
	if newer.ID == old.ID || newer.Attempt != 1 {
		t.Fatalf("new job %d attempt %d", newer.ID, newer.Attempt)
	}
	late := reply("k", 1, false) // same key and attempt number as the new job
	late.Reply.JobID = &old.ID
	res := applyReplies(t, st, late)
	if res.Verdicts[0] != correlator.Duplicate {
		t.Fatalf("late reply: %v, want duplicate", res.Verdicts[0])
	}
	wantState(t, get(t, st, "k"), correlator.StateRunning, "", 1)
}

// Several replies for one job in one batch: the first wins.
func TestRepliesReducedWithinBatch(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"))
	c := claim(t, st, 1)[0]
	first := reply("a", 1, true)
	byID := reply("a", 1, false)
	byID.Reply.JobID = &c.ID
	res := applyReplies(t, st, first, byID, reply("a", 1, false))
	if res.Counts()[correlator.Apply] != 1 || res.Counts()[correlator.Duplicate] != 2 {
		t.Fatalf("counts %v", res.Counts())
	}
	wantState(t, get(t, st, "a"), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
}

// An early reply waits for its job's claim and is applied after it; one
// whose job never comes is dead-lettered past its TTL.
func TestEarlyReplies(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	applyReplies(t, st, reply("soon", 0, true), reply("never", 0, true))
	insert(t, st, job("soon"))
	c := claim(t, st, 1)[0]
	res, err := st.EarlyReplyApply(ctx, []store.AttemptRef{c.Ref()}, typeInfo)
	if err != nil || res.Counts()[correlator.Apply] != 1 {
		t.Fatalf("early apply: %+v %v", res, err)
	}
	wantState(t, get(t, st, "soon"), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	// The sweep keeps the unexpired one, then dead-letters it past its TTL.
	if res, _, _ := st.EarlyReplySweep(ctx, 0, 100, typeInfo); len(res.DeadLetters) != 0 {
		t.Fatalf("dead-lettered before its TTL: %+v", res)
	}
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_early_reply SET expires_at = now() - interval '1s'"); err != nil {
		t.Fatal(err)
	}
	res, _, err = st.EarlyReplySweep(ctx, 0, 100, typeInfo)
	if err != nil || len(res.DeadLetters) != 1 {
		t.Fatalf("past TTL: %+v %v", res, err)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_early_reply"); n != 0 {
		t.Fatalf("%d early replies left", n)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_dead_letter WHERE reason LIKE 'no_job:%' AND record_value = 'reply never'"); n != 1 {
		t.Fatalf("dead letter of the expired early reply missing its record")
	}
}

// A reply racing a timeout: the sweeper skips a row a reply holds, and its
// guarded write never overwrites the reply's outcome (River #1302).
func TestTimeoutRacingReply(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("a"), job("b"))
	claimSent(t, st, 2)
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_job SET started_at = now() - interval '2 hours'"); err != nil {
		t.Fatal(err)
	}
	tx, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) // (a failed check leaves it open)
	if _, err := tx.Exec(ctx, "SELECT 1 FROM hipq_job WHERE queue = 'default' AND job_key = 'a' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	done, err := st.JobTimeOutStuck(ctx, 100, typeInfo)
	if err != nil || len(done) != 1 {
		t.Fatalf("timed out %v, err %v; want only the unlocked job", done, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	applyReplies(t, st, reply("a", 1, true))
	if done, _ := st.JobTimeOutStuck(ctx, 100, typeInfo); len(done) != 0 {
		t.Fatalf("timed out a job the reply finalized: %v", done)
	}
	wantState(t, get(t, st, "a"), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	b := get(t, st, "b")
	wantState(t, b, correlator.StateRetry, "", 1)
	if b.Error != correlator.ErrorTimeout {
		t.Errorf("error %q, want timeout", b.Error)
	}
	if res := applyReplies(t, st, reply("b", 1, true)); res.Verdicts[0] != correlator.Stale {
		t.Fatalf("reply after its attempt timed out: %v, want stale", res.Verdicts[0])
	}
}

// Concurrent reply batches and sweeps over the same rows never deadlock
// and never apply one attempt twice.
func TestConcurrentRepliesAndSweeps(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	var jobs []*correlator.Job
	for i := range 200 {
		jobs = append(jobs, job(string(rune('a'+i%26))+string(rune('a'+i/26))))
	}
	insert(t, st, jobs...)
	claimed := claimSent(t, st, 200)
	if _, err := st.Pool().Exec(ctx, "UPDATE hipq_job SET started_at = now() - interval '2 hours'"); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	applied := make([]int, 4)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var rs []store.ReplyIn
			for i := len(claimed) - 1; i >= 0; i-- { // reverse order: lock order must not matter
				rs = append(rs, reply(claimed[i].JobKey, 1, true))
			}
			res, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: rs}, typeInfo)
			if err != nil {
				t.Error(err)
				return
			}
			applied[w] = res.Counts()[correlator.Apply]
		}()
	}
	var timedOut int
	wg.Add(1)
	go func() {
		defer wg.Done()
		done, err := st.JobTimeOutStuck(ctx, 1000, typeInfo)
		if err != nil {
			t.Error(err)
		}
		timedOut = len(done)
	}()
	wg.Wait()
	total := timedOut
	for _, n := range applied {
		total += n
	}
	if total != 200 {
		t.Fatalf("applied %v + timed out %d = %d, want each of 200 attempts resolved once", applied, timedOut, total)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_attempt WHERE outcome IS NULL"); n != 0 {
		t.Fatalf("%d attempts unresolved", n)
	}
}

func TestExpireAndPrune(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	past := time.Now().Add(-time.Minute)
	insert(t, st, job("exp", func(j *correlator.Job) { j.ExpiresAt = &past }), job("keep"))
	if n, err := st.JobExpire(ctx, 10); err != nil || n != 1 {
		t.Fatalf("expired %d, err %v", n, err)
	}
	e := get(t, st, "exp")
	wantState(t, e, correlator.StateFinal, correlator.OutcomeExpired, 0)
	if e.Error != correlator.ErrorExpired {
		t.Errorf("error %q", e.Error)
	}
	if err := st.DeadLetterInsert(ctx, []store.DeadLetter{{Kind: store.SourceIntake, Reason: "x: y", Source: store.Source{Received: time.Now().Add(-48 * time.Hour)}}}); err != nil {
		t.Fatal(err)
	}
	// A final job with attempts (retention deletes them with it: no
	// foreign key does it).
	insert(t, st, job("ran"))
	claim(t, st, 2)
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET state = 'final', outcome = 'succeeded' WHERE job_key = 'ran'`); err != nil {
		t.Fatal(err)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_attempt a JOIN hipq_job j ON j.queue = a.queue AND j.id = a.job_id WHERE j.job_key = 'ran'`); n != 1 {
		t.Fatalf("%d attempts of the job to prune, want 1", n)
	}
	if n, _ := st.JobPrune(ctx, -time.Second, 10); n != 2 {
		t.Fatalf("pruned %d, want the final jobs only", n)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_attempt a WHERE NOT EXISTS (SELECT 1 FROM hipq_job j WHERE j.queue = a.queue AND j.id = a.job_id)`); n != 0 {
		t.Fatalf("%d attempts left behind by the prune", n)
	}
	if n, _ := st.DeadLetterPrune(ctx, 24*time.Hour, 10); n != 1 {
		t.Fatalf("pruned %d dead letters, want 1", n)
	}
	if _, err := st.JobGet(ctx, "t", "exp"); err != correlator.ErrNotFound {
		t.Fatalf("pruned job: %v", err)
	}
	_ = json.RawMessage(nil)
}

// A reply is looked for in its type's queue first; a job elsewhere (its
// type moved to another queue while it ran, or a reply naming its job id
// alone) is found in its own queue and the reply applied there.
func TestReplyFindsItsJobInAnyQueue(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	moved := func(j *correlator.Job) { j.Queue = "before" }
	insert(t, st, job("k1", moved), job("k2", moved))
	c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "before", Limit: 2, Instance: "test"})
	if err != nil || len(c.Jobs) != 2 {
		t.Fatalf("claim: %v %v", c.Jobs, err)
	}
	byID := reply("", 0, true)
	byID.Reply.JobType, byID.Reply.JobKey, byID.Reply.JobID = "", "", &c.Jobs[1].ID
	res := applyReplies(t, st, reply(c.Jobs[0].JobKey, 0, true), byID) // type t's queue is "default"
	if len(res.Applied) != 2 || res.Applied[0].Queue != "before" {
		t.Fatalf("applied %+v (verdicts %v)", res.Applied, res.Verdicts)
	}
	for _, j := range c.Jobs {
		wantState(t, get(t, st, j.JobKey), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	}
}

// Each applied reply says its index in the batch, the attempt it ended
// and that attempt's own round trip, though the writes come back grouped
// by queue: here the later reply's job is of the queue written first.
func TestAppliedRepliesCarryTheirRoundTrips(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("x"), job("y", func(j *correlator.Job) { j.Queue = "a" }))
	ran := map[string]time.Duration{"x": 10 * time.Minute, "y": 20 * time.Minute}
	ids := map[string]int64{}
	for _, q := range []string{"a", "default"} {
		c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: q, Limit: 1, Instance: "test"})
		if err != nil || len(c.Jobs) != 1 {
			t.Fatalf("claim %s: %v %v", q, c.Jobs, err)
		}
		k := c.Jobs[0].JobKey
		ids[k] = c.Jobs[0].ID
		if _, err := st.Pool().Exec(ctx, "UPDATE hipq_job SET started_at = now() - $2::interval WHERE id = $1", ids[k], ran[k]); err != nil {
			t.Fatal(err)
		}
	}
	y := ids["y"]
	toY := reply("", 0, true) // by job id alone
	toY.Reply.JobType, toY.Reply.JobKey, toY.Reply.JobID = "", "", &y
	res := applyReplies(t, st, reply("x", 1, true), reply("nojob", 0, true), toY)
	if len(res.Applied) != 2 {
		t.Fatalf("applied %+v (verdicts %v), want 2", res.Applied, res.Verdicts)
	}
	for i, want := range []struct {
		index int
		key   string
	}{{0, "x"}, {2, "y"}} {
		a := res.Applied[i]
		if a.Index != want.index || a.JobID != ids[want.key] || a.Attempt != 1 || a.Res.Outcome != correlator.OutcomeSucceeded {
			t.Errorf("applied[%d]: got index %d job %d attempt %d outcome %q, want index %d job %d (%s) attempt 1 succeeded",
				i, a.Index, a.JobID, a.Attempt, a.Res.Outcome, want.index, ids[want.key], want.key)
		}
		if rt := a.RoundTrip; rt.JobType != "t" || rt.Elapsed < ran[want.key] || rt.Elapsed > ran[want.key]+time.Minute {
			t.Errorf("applied[%d] (%s): got round trip %+v, want type t, about %v", i, want.key, rt, ran[want.key])
		}
		if res.RoundTrips()[i] != a.RoundTrip {
			t.Errorf("RoundTrips()[%d] = %+v, want %+v", i, res.RoundTrips()[i], a.RoundTrip)
		}
	}
	if n := res.Counts(); n[correlator.Apply] != 2 || n[correlator.Early] != 1 || len(n) != 2 {
		t.Errorf("counts %v, want 2 applied and 1 early", n)
	}
}

// Replies lock their rows in (queue, id) order, the order of every other
// path, even when some name their job by id alone (found by a read
// first): a reply batch waiting for one job's lock holds no lock on a job
// of a later queue, so the holder can take that one without a deadlock.
func TestRepliesLockInQueueOrder(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("x"), job("y", func(j *correlator.Job) { j.Queue = "a" }))
	var ids []int64
	for _, q := range []string{"a", "default"} {
		c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: q, Limit: 1, Instance: "test"})
		if err != nil || len(c.Jobs) != 1 {
			t.Fatalf("claim %s: %v %v", q, c.Jobs, err)
		}
		ids = append(ids, c.Jobs[0].ID)
	}
	y, x := ids[0], ids[1]
	holder, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, "SELECT 1 FROM hipq_job WHERE queue = 'a' AND id = $1 FOR UPDATE", y); err != nil {
		t.Fatal(err)
	}
	byID := reply("", 0, true)
	byID.Reply.JobType, byID.Reply.JobKey, byID.Reply.JobID = "", "", &y
	done := make(chan error, 1)
	go func() {
		_, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{reply("x", 0, true), byID}, EarlyTTL: time.Minute}, typeInfo)
		done <- err
	}()
	testutil.Eventually(t, 10*time.Second, func() bool { return count(t, st, waiting) > 0 },
		"the replies to wait for the held job")
	if _, err := holder.Exec(ctx, "SELECT 1 FROM hipq_job WHERE queue = 'default' AND id = $1 FOR UPDATE NOWAIT", x); err != nil {
		t.Fatalf("the replies hold job x (queue default) while waiting for job y (queue a): %v", err)
	}
	if err := holder.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"x", "y"} {
		wantState(t, get(t, st, k), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	}
}

// A reply that came with its send is the answer to that request: a reply
// kept earlier for the same job (another channel's, or an earlier
// attempt's) never overrides it.
func TestSyncReplyWinsOverEarlyReply(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	applyReplies(t, st, reply("k", 0, false)) // kept: no job yet
	insert(t, st, job("k"))
	c := claim(t, st, 1)[0]
	sync := reply("k", c.Attempt, true)
	sync.Reply.JobID, sync.Kind, sync.Queue = &c.ID, store.SourceCallback, c.Queue
	res, err := st.DeliveryRecord(ctx, store.Delivery{Sent: []store.AttemptRef{c.Ref()}, Replies: []store.ReplyIn{sync}}, typeInfo)
	if err != nil || len(res.Replies.Applied) != 1 {
		t.Fatalf("the sync reply was not applied: %+v %v", res.Replies, err)
	}
	wantState(t, get(t, st, "k"), correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	if n := count(t, st, "SELECT count(*) FROM hipq_early_reply"); n != 0 {
		t.Fatalf("%d early replies left", n)
	}
}

// An early reply keeps its retry_after: a failure kept before its job was
// sent schedules the retry no earlier than it says (a delay counted from
// the reply's arrival), not by the policy's backoff (a minute here).
func TestEarlyReplyKeepsRetryAfter(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	at := time.Now().Add(45 * time.Minute).UTC().Truncate(time.Second)
	delayed, until := reply("delay", 0, false), reply("until", 0, false)
	delayed.Reply.RetryAfter = correlator.RetryAfter{Delay: 30 * time.Minute}
	until.Reply.RetryAfter = correlator.RetryAfter{At: at}
	applyReplies(t, st, delayed, until) // kept: no job yet
	insert(t, st, job("delay"), job("until"))
	var sent []store.AttemptRef
	for _, c := range claim(t, st, 2) {
		sent = append(sent, c.Ref())
	}
	res, err := st.DeliveryRecord(ctx, store.Delivery{Sent: sent}, typeInfo)
	if err != nil || len(res.Early.Applied) != 2 {
		t.Fatalf("early replies applied: %+v %v", res.Early, err)
	}
	for key, earliest := range map[string]time.Time{"delay": time.Now().Add(29 * time.Minute), "until": at} {
		j := get(t, st, key)
		wantState(t, j, correlator.StateRetry, "", 1)
		if j.ScheduledRunTime.Before(earliest) {
			t.Errorf("%s: retry at %v, before the reply's retry_after (%v)", key, j.ScheduledRunTime, earliest)
		}
	}
}

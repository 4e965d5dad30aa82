package store_test

import (
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// An undone claim gives its attempt number back, and the job's next claim
// takes it again. A delivery record of the first claim that lands after
// that (its transaction tried again through an outage while the sweeper
// took the claim for lost) must move nothing of the second claim, whose
// request has not left: not mark it sent (a dead dispatcher's claim would
// then time out, an attempt burned), not undo it (its request would go
// twice), not end it with the first send's error.
func TestLateRecordMovesItsOwnClaimOnly(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("sent"), job("undo"), job("failed"))
	keyed := func(cs []store.Claimed) map[string]store.Claimed {
		m := map[string]store.Claimed{}
		for _, c := range cs {
			m[c.JobKey] = c
		}
		return m
	}
	first := keyed(claim(t, st, 3))
	// The sweeper's rescue: the claims are old and unsent, so the sweeper
	// undoes them, as it found them.
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_attempt SET dispatched_at = now() - interval '1 hour';
		UPDATE hipq_job SET started_at = now() - interval '1 hour' WHERE state = 'running'`); err != nil {
		t.Fatal(err)
	}
	unsent, _, err := st.AttemptFindUnsent(ctx, typeInfo, time.Second, 10, nil)
	if err != nil || len(unsent) != 3 {
		t.Fatalf("found %d unsent claims of 3: %v", len(unsent), err)
	}
	rescue := make([]store.AttemptRef, len(unsent))
	for i, u := range unsent {
		if !u.Claim.Equal(u.DispatchedAt) {
			t.Fatalf("the rescue would act on claim %v of an attempt dispatched at %v", u.Claim, u.DispatchedAt)
		}
		rescue[i] = u.AttemptRef
	}
	if n, err := st.JobUndoClaim(ctx, rescue); err != nil || n != 3 {
		t.Fatalf("rescue undid %d of 3: %v", n, err)
	}
	second := keyed(claim(t, st, 3))
	// A rescue acting again on what it read (a stale read) leaves them be.
	if n, err := st.JobUndoClaim(ctx, rescue); err != nil || n != 0 {
		t.Fatalf("a stale rescue undid %d of the new claims: %v", n, err)
	}
	for k, c := range second {
		if c.Attempt != first[k].Attempt || c.StartedAt.Equal(first[k].StartedAt) {
			t.Fatalf("%s: claimed again as attempt %d at %v, first %d at %v", k, c.Attempt, c.StartedAt, first[k].Attempt, first[k].StartedAt)
		}
	}
	fail := func(c store.Claimed) store.Resolve {
		_, res := correlator.SendUnknown(&correlator.JobType{Delivery: correlator.AtMostOnce}, "the first send's error")
		return store.Resolve{Queue: c.Queue, JobID: c.ID, Attempt: c.Attempt, Claim: c.StartedAt, Res: res}
	}
	record := func(cs map[string]store.Claimed) store.DeliveryResult {
		t.Helper()
		sent, undo := cs["sent"], cs["undo"]
		res, err := st.DeliveryRecord(ctx, store.Delivery{
			Sent: []store.AttemptRef{sent.Ref()}, Undo: []store.AttemptRef{undo.Ref()},
			Resolves: []store.Resolve{fail(cs["failed"])}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	// The first claim's record lands late.
	if res := record(first); res.Undone != 0 {
		t.Fatalf("the late record undid %d of the second claims", res.Undone)
	}
	for _, k := range []string{"sent", "undo", "failed"} {
		wantState(t, get(t, st, k), correlator.StateRunning, "", 1)
	}
	if n := count(t, st, `SELECT count(*) FROM hipq_attempt WHERE sent_at IS NOT NULL OR outcome IS NOT NULL`); n != 0 {
		t.Fatalf("the late record marked or ended %d of the second claims' attempts", n)
	}
	// The second claims' own record moves them.
	if res := record(second); res.Undone != 1 {
		t.Fatalf("the second claims' record undid %d, want 1", res.Undone)
	}
	wantState(t, get(t, st, "sent"), correlator.StateRunning, "", 1)
	wantState(t, get(t, st, "undo"), correlator.StateInitial, "", 0)
	wantState(t, get(t, st, "failed"), correlator.StateFinal, correlator.OutcomeFailed, 1)
	if n := count(t, st, `SELECT count(*) FROM hipq_attempt WHERE sent_at IS NOT NULL`); n != 1 {
		t.Fatalf("%d attempts marked sent, want 1", n)
	}
	// A ref that names no claim (a reply's) moves whichever claim holds the attempt.
	c := second["sent"]
	r := store.Resolve{Queue: c.Queue, JobID: c.ID, Attempt: c.Attempt, Res: fail(c).Res}
	if done, err := st.JobResolveMany(ctx, []store.Resolve{r}); err != nil || len(done) != 1 {
		t.Fatalf("a resolve naming no claim: %v %v", done, err)
	}
}

// The rescue's end of an at_most_once claim is guarded as its undo is: a
// send recorded (or news come) between the rescue's read and its write
// proves the request left, and its reply is on its way, so the claim is
// not ended "may have been delivered": the rescue's resolve checks that
// the attempt is still unsent, not only that its claim is the one read.
func TestRescueLeavesAClaimSentSinceItsRead(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("sent"), job("news"), job("lost"))
	cs := map[string]store.Claimed{}
	for _, c := range claim(t, st, 3) {
		cs[c.JobKey] = c
	}
	unsent, _, err := st.AttemptFindUnsent(ctx, typeInfo, -time.Hour, 10, nil) // a grace that makes every claim lost
	if err != nil || len(unsent) != 3 {
		t.Fatalf("found %d of 3: %v", len(unsent), err)
	}
	// Meanwhile a record lands (PostgreSQL back after an outage), and news.
	sent := cs["sent"]
	if _, err := st.DeliveryRecord(ctx, store.Delivery{Sent: []store.AttemptRef{sent.Ref()}}, nil); err != nil {
		t.Fatal(err)
	}
	if res, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{progress("news", 1)}, EarlyTTL: time.Minute}, newsTypes()); err != nil || res.Verdicts[0] != correlator.Progressed {
		t.Fatalf("news: %v %v", res.Verdicts, err)
	}
	_, res := correlator.SendUnknown(&correlator.JobType{Delivery: correlator.AtMostOnce}, "claimed but not known to be sent")
	var fail []store.Resolve
	for _, u := range unsent {
		fail = append(fail, store.Resolve{Queue: u.Queue, JobID: u.JobID, Attempt: u.Attempt, Claim: u.Claim, Res: res})
	}
	done, err := st.JobFailUnsent(ctx, fail)
	if err != nil || len(done) != 1 || done[0].JobID != cs["lost"].ID {
		t.Fatalf("ended %v, want only the lost claim: %v", done, err)
	}
	wantState(t, get(t, st, "sent"), correlator.StateRunning, "", 1)
	wantState(t, get(t, st, "news"), correlator.StateRunning, "", 1)
	wantState(t, get(t, st, "lost"), correlator.StateFinal, correlator.OutcomeFailed, 1)
}

// A claim whose transaction is still open when a search for unsent claims
// reads is not seen by it, though its started_at (its transaction's start)
// may lie before the range read: the search's marks stay at or before the
// start of every transaction open then, so the next search from them,
// once the claim is committed, finds it.
func TestUnsentMarksWaitForOpenClaims(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("seen"))
	claim(t, st, 1)
	tx, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `WITH j AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, job_data, state, attempt, started_at)
		  VALUES ('default', 't', 'late', '{}', 'running', 1, now()) RETURNING id, started_at)
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at) SELECT 'default', id, 1, 'i', started_at FROM j`); err != nil {
		t.Fatal(err)
	}
	// A grace that makes every claim lost: the open claim lies within the
	// range read, but cannot be seen.
	unsent, marks, err := st.AttemptFindUnsent(ctx, typeInfo, -time.Hour, 10, nil)
	if err != nil || len(unsent) != 1 {
		t.Fatalf("found %d: %v", len(unsent), err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	unsent, _, err = st.AttemptFindUnsent(ctx, typeInfo, -time.Hour, 10, marks)
	if err != nil || len(unsent) != 2 {
		t.Fatalf("found %d from the marks, want the claim committed since: %v", len(unsent), err)
	}
}

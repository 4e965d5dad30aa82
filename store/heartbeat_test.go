package store_test

import (
	"encoding/json"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

func progress(key string, attempt int) store.ReplyIn {
	r := &correlator.Reply{JobType: "t", JobKey: key, Attempt: &attempt, Progress: true, Result: json.RawMessage(`{"pct":50}`)}
	return store.ReplyIn{Reply: r, Kind: store.SourceReply, Source: store.Source{Topic: "replies"}}
}

// newsTypes is the tests' type t with news allowed to move a deadline up
// to 2 hours after the claim (max_timeout).
func newsTypes() correlator.Types {
	jt := *types["t"]
	jt.MaxTimeout = 2 * time.Hour
	return correlator.Types{"t": &jt}
}

// Progress moves a running attempt's deadline, never past max_timeout,
// and records the payload; on a job not running it is counted, never
// dead-lettered nor kept.
func TestProgressReplies(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	tys := newsTypes()
	insert(t, st, job("run"), job("waiting"))
	claim(t, st, 1)
	res, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{progress("run", 1), progress("waiting", 1),
		progress("nojob", 1), progress("run", 1)}, EarlyTTL: time.Minute}, tys)
	if err != nil {
		t.Fatal(err)
	}
	want := []correlator.Verdict{correlator.Progressed, correlator.Stale, correlator.Stale, correlator.Progressed}
	for i, v := range res.Verdicts {
		if v != want[i] {
			t.Errorf("progress %d: %v, want %v", i, v, want[i])
		}
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_early_reply") + count(t, st, "SELECT count(*) FROM hipq_dead_letter"); n != 0 {
		t.Errorf("%d progress replies kept or dead-lettered", n)
	}
	// timeout 1h from the claim → now + 1h, within started + 2h.
	if n := count(t, st, `SELECT count(*) FROM hipq_attempt WHERE progress = '{"pct":50}' AND progress_at IS NOT NULL
		AND deadline > now() + interval '59 minutes' AND deadline <= now() + interval '1 hour'`); n != 1 {
		t.Errorf("the attempt's deadline and progress were not recorded")
	}
	wantState(t, get(t, st, "run"), correlator.StateRunning, "", 1)
	// Past max_timeout news extends nothing: the sweeper times it out.
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET started_at = now() - interval '3 hours' WHERE job_key = 'run';
		UPDATE hipq_attempt SET deadline = now() - interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	res, err = st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{progress("run", 1)}}, tys)
	if err != nil || res.Verdicts[0] != correlator.Stale {
		t.Fatalf("news after the deadline: %v %v, want stale", res.Verdicts, err)
	}
	if done, err := st.JobTimeOutStuck(ctx, 100, tys); err != nil || len(done) != 1 {
		t.Fatalf("timed out %v %v", done, err)
	}
}

// A heartbeat racing a timeout: exactly one wins. Jobs whose deadlines
// fall in the race get progress at random moments while sweeps run;
// after, every job whose news was accepted still runs (with a later
// deadline), every other was timed out, and none both.
func TestHeartbeatRacingTimeout(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	tys := newsTypes()
	const n = 120
	var keys []string
	for i := range n {
		k := "race-" + string(rune('a'+i%26)) + string(rune('a'+i/26))
		keys = append(keys, k)
		insert(t, st, job(k))
	}
	claimSent(t, st, n)
	// Deadlines spread over the next 300 ms.
	// (to_timestamp of a number: Citus updates rows only with immutable
	// functions of their columns.)
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET started_at = to_timestamp($1::float8 + (id % 300) / 1000.0)`,
		float64(time.Now().Add(-time.Hour).UnixMicro())/1e6); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var mu sync.Mutex
	accepted := map[string]bool{}
	var wg sync.WaitGroup
	for _, k := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(rand.IntN(500)) * time.Millisecond)
			res, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{progress(k, 1)}}, tys)
			if err != nil {
				t.Error(err)
				return
			}
			if res.Verdicts[0] == correlator.Progressed {
				mu.Lock()
				accepted[k] = true
				mu.Unlock()
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for time.Since(start) < 800*time.Millisecond {
			if _, err := st.JobTimeOutStuck(ctx, 1000, tys); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	wg.Wait()
	if _, err := st.JobTimeOutStuck(ctx, 1000, tys); err != nil {
		t.Fatal(err)
	}
	var running, timedOut int
	for _, k := range keys {
		j := get(t, st, k)
		switch {
		case accepted[k] && j.State == correlator.StateRunning:
			running++
		case !accepted[k] && j.State == correlator.StateRetry && j.Error == "timeout":
			timedOut++
		default:
			t.Errorf("%s: news accepted %v, job %s/%s: both or neither won", k, accepted[k], j.State, j.Error)
		}
	}
	if running == 0 || timedOut == 0 {
		t.Logf("no real race this run: %d extended, %d timed out", running, timedOut)
	}
	t.Logf("%d extended, %d timed out", running, timedOut)
}

// News of an attempt proves its request left: an attempt whose sent mark
// is missing (a progress reply came before it) is never taken for unsent.
func TestNewsIsNeverUnsent(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	insert(t, st, job("quiet"), job("newsy"))
	claim(t, st, 2)
	if _, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{progress("newsy", 1)}, EarlyTTL: time.Minute}, types); err != nil {
		t.Fatal(err)
	}
	// (a running job's started_at is its attempt's dispatched_at)
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_attempt SET dispatched_at = now() - interval '1 hour';
		UPDATE hipq_job SET started_at = now() - interval '1 hour' WHERE state = 'running'`); err != nil {
		t.Fatal(err)
	}
	unsent, _, err := st.AttemptFindUnsent(ctx, types, time.Second, 10, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(unsent) != 1 || unsent[0].JobID != get(t, st, "quiet").ID {
		t.Fatalf("unsent: %+v, want only the quiet attempt", unsent)
	}
}

// News proves a request left: a claim whose attempt got news is never
// undone, though no send was recorded (the rescue read it as unsent just
// before the news came, or the dispatcher's record says not sent). Undone,
// it would be sent again under the same attempt number (invariants 2, 8).
func TestNewsKeepsAClaimFromBeingUndone(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	tys := newsTypes()
	insert(t, st, job("news"), job("none"))
	c := claim(t, st, 2)
	res, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{progress("news", 1)}, EarlyTTL: time.Minute}, tys)
	if err != nil || res.Verdicts[0] != correlator.Progressed {
		t.Fatalf("news: %v %v", res.Verdicts, err)
	}
	refs := []store.AttemptRef{c[0].Ref(), c[1].Ref()}
	n, err := st.JobUndoClaim(ctx, refs)
	if err != nil || n != 1 {
		t.Fatalf("undid %d claims, want only the one without news: %v", n, err)
	}
	wantState(t, get(t, st, "news"), correlator.StateRunning, "", 1)
	wantState(t, get(t, st, "none"), correlator.StateInitial, "", 0)
}

package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var ctx = context.Background()

var types = map[string]*correlator.JobType{
	"t": {Name: "t", Queue: "default", Timeout: time.Hour, Priority: 100, ThrottleFactor: 1, Delivery: correlator.AtLeastOnce,
		Retry: &correlator.Backoff{Attempts: 3, Initial: time.Minute, When: []correlator.AttemptOutcome{correlator.AttemptFailed, correlator.AttemptTimedOut, correlator.AttemptDispatchError}}},
}

var typeInfo = correlator.Types(types)

// job is the test factory: a new job of type t with optional changes.
func job(key string, opts ...func(*correlator.Job)) *correlator.Job {
	j := &correlator.Job{Queue: "default", JobType: "t", JobKey: key, JobData: json.RawMessage(`{"k":"` + key + `"}`),
		MaxAttempts: 3, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)}
	for _, o := range opts {
		o(j)
	}
	return j
}

func insert(t testing.TB, st *store.Store, jobs ...*correlator.Job) {
	t.Helper()
	if _, err := st.JobsInsert(ctx, jobs); err != nil {
		t.Fatal(err)
	}
}

func claim(t *testing.T, st *store.Store, limit int) []store.Claimed {
	t.Helper()
	c, err := st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: limit, Instance: "test"})
	if err != nil {
		t.Fatal(err)
	}
	return c.Jobs
}

// claimSent claims as claim does, then marks the attempts sent, as a
// dispatcher does once the transport acknowledged them: the jobs then
// time out as requests that left.
func claimSent(t *testing.T, st *store.Store, limit int) []store.Claimed {
	t.Helper()
	c := claim(t, st, limit)
	refs := make([]store.AttemptRef, len(c))
	for i, j := range c {
		refs[i] = j.Ref()
	}
	if err := st.AttemptMarkSent(ctx, refs); err != nil {
		t.Fatal(err)
	}
	return c
}

func get(t *testing.T, st *store.Store, key string) *correlator.Job {
	t.Helper()
	j, err := st.JobGet(ctx, "t", key)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	return j
}

func wantState(t *testing.T, j *correlator.Job, state correlator.State, outcome correlator.Outcome, attempt int) {
	t.Helper()
	if j.State != state || j.Outcome != outcome || j.Attempt != attempt {
		t.Fatalf("job %s: got state %s outcome %q attempt %d, want %s %q %d (error %q)", j.JobKey, j.State, j.Outcome, j.Attempt, state, outcome, attempt, j.Error)
	}
}

func count(t testing.TB, st *store.Store, q string, args ...any) int {
	t.Helper()
	var n int
	if err := st.Pool().QueryRow(ctx, q, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

func reply(key string, attempt int, ok bool) store.ReplyIn {
	r := &correlator.Reply{JobType: "t", JobKey: key, Success: ok, Retryable: true, Result: json.RawMessage(`{"r":1}`)}
	if attempt > 0 {
		r.Attempt = &attempt
	}
	if !ok {
		r.Error = "nope"
	}
	return store.ReplyIn{Reply: r, Kind: store.SourceReply, Source: store.Source{Topic: "replies", Value: []byte(fmt.Sprintf("reply %s", key))}}
}

func applyReplies(t *testing.T, st *store.Store, rs ...store.ReplyIn) store.ReplyResult {
	t.Helper()
	res, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: rs, EarlyTTL: time.Minute}, typeInfo)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

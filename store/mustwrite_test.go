package store_test

import (
	"errors"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// A reply batch that must write (a consumer comparing a refused record
// with the next) writes only when a reply ends or moves its attempt: a
// reply kept early, for a job not stored yet, writes neither its job nor
// its attempt, so it shows nothing of a refusal of those writes (a
// privilege revoked on hipq_job) and the batch rolls back.
func TestMustWriteNeedsAReplyApplied(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	_, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{reply("not-yet", 1, true)}, EarlyTTL: time.Minute,
		MustWrite: true}, types)
	if !errors.Is(err, store.ErrNoWrite) {
		t.Fatalf("a batch whose one reply is kept early: %v, want ErrNoWrite", err)
	}
	if n := count(t, st, "SELECT count(*) FROM hipq_early_reply"); n != 0 {
		t.Errorf("%d early replies kept by a batch rolled back", n)
	}
	insert(t, st, job("run"))
	claimWith(t, st, store.JobClaimParams{})
	if _, err := st.ReplyApply(ctx, store.ReplyBatch{Replies: []store.ReplyIn{reply("run", 1, true)}, MustWrite: true}, types); err != nil {
		t.Fatalf("a batch whose reply is applied: %v", err)
	}
}

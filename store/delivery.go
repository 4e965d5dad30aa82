package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// Delivery is the whole record of what became of a batch of sends: one
// transport's share of one claim. Each job is in at most one of the lists
// (a job with a sync reply is in Sent and Replies).
type Delivery struct {
	// Sent: the transport acknowledged the request, or the downstream
	// answered: sent_at.
	Sent []AttemptRef
	// Undo: the request surely never left: the claim is taken back, and
	// its rate units given back.
	Undo []AttemptRef
	// Resend: the request may have left (an at_least_once send in doubt):
	// the claim is taken back to be sent again, and its rate units keep
	// counting.
	Resend []AttemptRef
	// Resolves end attempts the send itself decided (dispatch errors, a
	// send of an at_most_once type that may have arrived).
	Resolves []Resolve
	// Replies came with the send (HTTP sync mode).
	Replies []ReplyIn
}

// Jobs lists the ids of the jobs the delivery names.
func (d *Delivery) Jobs() []int64 {
	var ids []int64
	for _, r := range d.Sent {
		ids = append(ids, r.JobID)
	}
	for _, r := range d.Undo {
		ids = append(ids, r.JobID)
	}
	for _, r := range d.Resend {
		ids = append(ids, r.JobID)
	}
	for _, r := range d.Resolves {
		ids = append(ids, r.JobID)
	}
	return ids
}

// refs names the attempts the delivery moves or marks, and those its
// replies name by job id in a queue it knows.
func (d *Delivery) refs() []AttemptRef {
	refs := append(append(append([]AttemptRef(nil), d.Sent...), d.Undo...), d.Resend...)
	for _, r := range d.Resolves {
		refs = append(refs, r.Ref())
	}
	for _, r := range d.Replies {
		if r.Reply.JobID != nil && r.Queue != "" {
			refs = append(refs, AttemptRef{Queue: r.Queue, JobID: *r.Reply.JobID})
		}
	}
	return refs
}

// DeliveryResult says what the record did.
type DeliveryResult struct {
	Undone  int
	Replies ReplyResult // of Delivery.Replies
	Early   ReplyResult // early replies waiting for the jobs sent
}

// DeliveryRecord writes a delivery's whole record in one transaction:
// sent_at of what was sent, the undo of what never left, the attempts the
// send ended, the replies that came with it, and then the early replies
// that were waiting for the jobs sent. Either all of it lands or none: a
// failure in between can never leave a delivered request looking unsent
// (which the sweeper would undo and send again) or lose a reply. The
// caller retries a transient failure (IsTransient) until it lands.
//
// A record locks its jobs' rows first, in (queue, id) order, as the reply
// paths lock them, so a delivery and a reply for the same jobs queue
// up instead of deadlocking.
func (s *Store) DeliveryRecord(ctx context.Context, d Delivery, types correlator.Types) (DeliveryResult, error) {
	var res DeliveryResult
	// Every transaction that writes attempt rows holds their jobs' locks
	// first, taken in (queue, id) order: then the order in which a
	// statement's plan reaches the attempt rows never matters, and two
	// such transactions wait for each other in turn, never in a cycle.
	// (Marks taking attempt rows alone deadlocked with replies that wrote
	// the same attempts in another order.) The locks and the sent marks go
	// with the BEGIN, in its round trip.
	open := func(b *pgx.Batch) error {
		if err := lockJobs(ctx, queued{b, "delivered jobs"}, d.refs()); err != nil {
			return fmt.Errorf("delivered jobs: %w", err)
		}
		return attemptsMarkSent(ctx, queued{b, "mark attempts sent"}, d.Sent)
	}
	err := s.inTxOpen(ctx, open, func(tx pgx.Tx) error {
		res = DeliveryResult{}
		var err error
		if res.Undone, err = jobsUndoClaim(ctx, tx, d.Undo, true); err != nil {
			return err
		}
		resent, err := jobsUndoClaim(ctx, tx, d.Resend, false)
		if err != nil {
			return err
		}
		res.Undone += resent
		// A resolution whose guard does not match was overtaken by another
		// writer (a reply, the sweeper): the guard keeps both from applying.
		done, err := jobResolveMany(ctx, tx, s.events, d.Resolves)
		if err != nil {
			return err
		}
		if err := rateGiveBack(ctx, tx, neverLeft(d.Resolves, done)); err != nil {
			return err
		}
		if len(d.Replies) > 0 {
			if res.Replies, err = applyReplies(ctx, tx, s.events, d.Replies, types, 0, time.Time{}); err != nil {
				return err
			}
			if err := deadLettersInsert(ctx, tx, res.Replies.DeadLetters); err != nil {
				return err
			}
		}
		// Then the early replies waiting for the jobs sent (after a reply
		// that came with the send: that one is the answer to this request).
		if len(d.Sent) > 0 {
			if res.Early, _, err = earlyReplyApply(ctx, tx, s.events, d.Sent, 0, 0, types); err != nil {
				return err
			}
		}
		return nil
	})
	return res, err
}

package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// AttemptRef names one attempt of one job.
type AttemptRef struct {
	Queue   string
	JobID   int64
	Attempt int
	// Claim, when set, is the claim's started_at (PostgreSQL's clock, as
	// the claim or a read of it returned it): a write acting on what it
	// claimed or read then moves that claim only. An undone claim gives
	// its attempt number back, and the next claim of the job takes it
	// again: a record that lands late (its transaction tried again through
	// an outage while the sweeper undid the claim) must not mark, undo or
	// end the new claim, whose request has not left. Zero: any claim of
	// the attempt (a reply names no claim).
	Claim time.Time
}

func refArrays(refs []AttemptRef) ([]int64, []int32) {
	ids, atts := make([]int64, len(refs)), make([]int32, len(refs))
	for i, r := range refs {
		ids[i], atts[i] = r.JobID, int32(r.Attempt)
	}
	return ids, atts
}

// claimsOf returns the claims refs name (NULL where unset), or nil when
// none does: unnest pads a shorter array, a NULL one included, with NULLs.
func claimsOf[T any](xs []T, claim func(T) time.Time) []*time.Time {
	var out []*time.Time
	for i, x := range xs {
		c := claim(x)
		if c.IsZero() {
			continue
		}
		if out == nil {
			out = make([]*time.Time, len(xs))
		}
		out[i] = &c
	}
	return out
}

func refClaim(r AttemptRef) time.Time { return r.Claim }

// AttemptMarkSent records that the transport acknowledged the sends.
func (s *Store) AttemptMarkSent(ctx context.Context, refs []AttemptRef) error {
	return s.inTx(ctx, func(tx pgx.Tx) error {
		if err := lockJobs(ctx, tx, refs); err != nil { // (see DeliveryRecord)
			return err
		}
		return attemptsMarkSent(ctx, tx, refs)
	})
}

// markSentSQL marks attempts sent. Each is looked up by its key in a
// subquery the planner cannot flatten (OFFSET 0), so the lookup is a
// primary-key probe whatever the statistics say, and the row is updated
// by the very version looked at (its ctid). A plain join would let the
// planner scan hipq_attempt for "sent_at IS NULL" when statistics say no
// row has it: quadratic in the batch beside many final attempts. The
// versions found are collected first (an array the statement computes
// once) and updated by tuple id (or, on a stale plan, found by one scan
// comparing each row with the array): joined to the update instead, a
// table never analyzed (its queue's rows estimated at one) would be
// scanned with every probe of the batch run again for each of its rows,
// as at the start of a burst into an empty table
// (TestPlansOfEmptyTablesStayLinear). The versions found stay current:
// every writer of attempt rows takes their jobs' locks first, as the
// caller has. (A row changed by a writer that did not would be left
// alone.) A ref naming its claim marks that claim's attempt only (its
// dispatched_at is the claim's started_at).
// (The queue is $1: PostgreSQL 15's EXPLAIN numbers the subquery's
// output from where the lateral references stop, and with the queue at
// $3 or $4 the two would read alike: TestEveryWriteNamesItsQueue.)
const markSentSQL = `
	UPDATE hipq_attempt a SET sent_at = now()
	WHERE a.queue = $1 AND a.ctid = ANY (ARRAY(
	  SELECT x.ctid FROM unnest($2::bigint[], $3::int[], $4::timestamptz[]) AS u(id, att, claim)
	  CROSS JOIN LATERAL (SELECT b.ctid FROM hipq_attempt b
	                      WHERE b.queue = $1 AND b.job_id = u.id AND b.attempt = u.att AND b.sent_at IS NULL
	                        AND (u.claim IS NULL OR b.dispatched_at = u.claim)
	                      OFFSET 0) x))`

func attemptsMarkSent(ctx context.Context, tx execer, refs []AttemptRef) error {
	err := perQueue(refs, refQueue, func(q string, refs []AttemptRef) error {
		ids, atts := refArrays(refs)
		_, err := tx.Exec(ctx, markSentSQL, q, ids, atts, claimsOf(refs, refClaim))
		return err
	})
	if err != nil {
		return fmt.Errorf("mark attempts sent: %w", err)
	}
	return nil
}

// JobUndoClaim takes back claims whose request never left (invariant 8):
// state, attempt, started_at and error are restored and the hipq_attempt row
// deleted, guarded by state running, the attempt (and the claim, when the
// ref names it), no sent_at and no news (news proves the request left,
// whatever the dispatcher recorded). Their rate units are given back. It
// returns how many were undone.
func (s *Store) JobUndoClaim(ctx context.Context, refs []AttemptRef) (int, error) {
	return s.undo(ctx, refs, true)
}

// JobUndoForResend takes back claims whose request may have left (a send
// in doubt, an instance lost between send and record) so that they are
// sent again, guarded as JobUndoClaim. Their requests keep counting in
// every rate window that applies to them, for a period from the claim
// that settles them: they may have reached the downstream.
func (s *Store) JobUndoForResend(ctx context.Context, refs []AttemptRef) (int, error) {
	return s.undo(ctx, refs, false)
}

func (s *Store) undo(ctx context.Context, refs []AttemptRef, giveBack bool) (int, error) {
	var n int
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		if err := lockJobs(ctx, tx, refs); err != nil { // (see DeliveryRecord)
			return err
		}
		var err error
		n, err = jobsUndoClaim(ctx, tx, refs, giveBack)
		return err
	})
	return n, err
}

// jobsUndoClaim undoes claims. giveBack: their requests never left, and
// the rate units of their claims still counting give them back (a row in
// hipq_rate_giveback, which the next claim of the queue takes out of the
// units, under the queue's lock); else they keep counting.
func jobsUndoClaim(ctx context.Context, tx pgx.Tx, refs []AttemptRef, giveBack bool) (int, error) {
	total := 0
	err := perQueue(refs, refQueue, func(q string, refs []AttemptRef) error {
		ids, atts := refArrays(refs)
		var n int
		err := tx.QueryRow(ctx, `
		WITH u AS (
		  SELECT * FROM unnest($1::bigint[], $2::int[], $4::timestamptz[]) AS u(id, att, claim)
		), undone AS (
		  UPDATE hipq_job j
		  SET state = CASE WHEN j.attempt = 1 THEN 'initial' ELSE 'retry' END,
		      attempt = j.attempt - 1,
		      started_at = prev.dispatched_at,
		      error = coalesce(prev.error, 'NONE'),
		      update_time = now()
		  FROM u
		  LEFT JOIN hipq_attempt prev ON prev.queue = $3 AND prev.job_id = u.id AND prev.attempt = u.att - 1
		  WHERE j.queue = $3 AND j.id = u.id AND j.state = 'running' AND j.attempt = u.att
		    AND (u.claim IS NULL OR j.started_at = u.claim)
		    AND EXISTS (SELECT 1 FROM hipq_attempt a
		                WHERE a.queue = $3 AND a.job_id = u.id AND a.attempt = u.att AND `+notKnownSent+`)
		  RETURNING j.id, u.att
		), del AS (
		  DELETE FROM hipq_attempt a USING undone
		  WHERE a.queue = $3 AND a.job_id = undone.id AND a.attempt = undone.att
		  RETURNING a.job_id, a.attempt, a.dispatched_at
		), back AS (
		  INSERT INTO hipq_rate_giveback (queue, job_id, attempt, claimed_at)
		  SELECT $3, del.job_id, del.attempt, del.dispatched_at FROM del
		  WHERE $5 AND EXISTS (SELECT 1 FROM hipq_rate_unit r
		                       WHERE r.queue = $3 AND r.claimed_at = del.dispatched_at AND r.at IS NULL)
		  ON CONFLICT DO NOTHING
		)
		SELECT count(*) FROM del`, ids, atts, q, claimsOf(refs, refClaim), giveBack).Scan(&n)
		total += n
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("undo claims: %w", err)
	}
	return total, nil
}

// neverLeft lists the claims of the resolutions that took effect (done)
// whose requests surely never left.
func neverLeft(rs []Resolve, done []resolved) []AttemptRef {
	var out []AttemptRef
	for _, r := range rs {
		if !r.NeverLeft || r.Claim.IsZero() {
			continue
		}
		for _, d := range done {
			if d.Queue == r.Queue && d.JobID == r.JobID && d.Attempt == r.Attempt {
				out = append(out, r.Ref())
				break
			}
		}
	}
	return out
}

// rateGiveBack gives back the requests of claims that surely never left
// and ended without an undo: a row in hipq_rate_giveback for each whose
// claim has a rate unit still counting (the next claim of the queue takes
// it out of the unit, under the queue's lock).
func rateGiveBack(ctx context.Context, tx pgx.Tx, refs []AttemptRef) error {
	err := perQueue(refs, refQueue, func(q string, refs []AttemptRef) error {
		ids, atts := refArrays(refs)
		_, err := tx.Exec(ctx, `
		INSERT INTO hipq_rate_giveback (queue, job_id, attempt, claimed_at)
		SELECT $1, u.id, u.att, u.claim FROM unnest($2::bigint[], $3::int[], $4::timestamptz[]) AS u(id, att, claim)
		WHERE EXISTS (SELECT 1 FROM hipq_rate_unit r WHERE r.queue = $1 AND r.claimed_at = u.claim AND r.at IS NULL)
		ON CONFLICT DO NOTHING`, q, ids, atts, claimsOf(refs, refClaim))
		return err
	})
	if err != nil {
		return fmt.Errorf("give back rate units: %w", err)
	}
	return nil
}

// notKnownSent is the condition on an attempt row (a) whose request is not
// known to have left: no sent_at, no news, no outcome. The search for
// unsent claims, the rescue's undo and end, and the timeouts (which leave
// these claims to the rescue) all read this one condition.
const notKnownSent = "a.sent_at IS NULL AND a.progress_at IS NULL AND a.outcome IS NULL"

// JobFailUnsent ends claims the rescue found unsent and may not undo
// (at_most_once: the request may have left), each as its Resolve says,
// guarded as the undo is: the claim named, still running, and its attempt
// still without sent_at, news or outcome (a send recorded, or news come,
// since the rescue read it proves the request left: its reply is on its
// way). It returns the refs that took effect.
func (s *Store) JobFailUnsent(ctx context.Context, rs []Resolve) ([]AttemptRef, error) {
	if len(rs) == 0 {
		return nil, nil
	}
	var done []resolved
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		refs := make([]AttemptRef, len(rs))
		for i, r := range rs {
			refs[i] = r.Ref()
		}
		if err := lockJobs(ctx, tx, refs); err != nil { // (see DeliveryRecord)
			return err
		}
		// Under the jobs' locks no attempt of theirs changes: every writer
		// of attempts takes them first.
		var still []Resolve
		err := perQueue(rs, func(r Resolve) string { return r.Queue }, func(q string, rs []Resolve) error {
			ids, atts := make([]int64, len(rs)), make([]int32, len(rs))
			for i, r := range rs {
				ids[i], atts[i] = r.JobID, int32(r.Attempt)
			}
			rows, err := tx.Query(ctx, `
				SELECT u.ord FROM unnest($1::bigint[], $2::int[]) WITH ORDINALITY AS u(id, att, ord)
				WHERE EXISTS (SELECT 1 FROM hipq_attempt a
				              WHERE a.queue = $3 AND a.job_id = u.id AND a.attempt = u.att
				                AND `+notKnownSent+`)`, ids, atts, q)
			if err != nil {
				return err
			}
			ords, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			for _, o := range ords {
				still = append(still, rs[o-1])
			}
			return err
		})
		if err != nil {
			return fmt.Errorf("fail unsent claims: %w", err)
		}
		done, err = jobResolveMany(ctx, tx, s.events, still)
		return err
	})
	return refsOf(done), err
}

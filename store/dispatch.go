package store

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// JobClaimParams says which due jobs to claim.
type JobClaimParams struct {
	Queue    string
	Order    correlator.Order // the queue's order; the zero Order is scheduled_first
	Limit    int
	Instance string // recorded on each hipq_attempt row
	// Types limits the claim to job types this instance can send; nil
	// claims every type.
	Types []string
	// Throttle bounds the queue's running jobs across every instance.
	Throttle correlator.Throttle
	// TypeWindows are the time windows of job types, for jobs without
	// their own.
	TypeWindows map[string][]correlator.TimeWindow
}

// Claimed is a job moved to running by a claim.
type Claimed struct {
	ID             int64
	Queue          string
	JobType        string
	JobKey         string
	JobData        json.RawMessage
	Attempt        int
	MaxAttempts    int
	TimeoutSeconds int
	ExpiresAt      *time.Time
	TimeWindows    []correlator.TimeWindow
	// WindowsErr says why the job's own time windows could not be read
	// (they are then left out of its retry scheduling; the claim, which
	// reads them in PostgreSQL, still applies them).
	WindowsErr error
	// Trace holds the headers that carry the send span's context (tracing
	// on): the transports write them on the request.
	Trace map[string]string
	// StartedAt is PostgreSQL's clock at the claim.
	StartedAt time.Time
	// ClaimedLocal is this process's clock (with its monotonic reading)
	// taken just before the claim was asked for: time.Since(ClaimedLocal)
	// bounds from above how long ago, on any clock, the claim was made.
	ClaimedLocal time.Time
}

// DBNow estimates PostgreSQL's clock now: its clock at the claim plus the
// local monotonic time since. Deadlines and schedules computed from it
// agree with the sweeper's and the claim's, which run on PostgreSQL's
// clock, however far this host's wall clock is off.
func (c *Claimed) DBNow() time.Time { return c.StartedAt.Add(time.Since(c.ClaimedLocal)) }

// Ref names the attempt the claim started, and the claim (its
// started_at): a record of this claim's send moves this claim only.
func (c *Claimed) Ref() AttemptRef {
	return AttemptRef{Queue: c.Queue, JobID: c.ID, Attempt: c.Attempt, Claim: c.StartedAt}
}

// Running returns what the retry decision needs.
func (c *Claimed) Running() correlator.Running {
	return correlator.Running{Attempt: c.Attempt, MaxAttempts: c.MaxAttempts, ExpiresAt: c.ExpiresAt, Windows: c.TimeWindows}
}

// Closed is a due job the claim found outside its time windows and left
// waiting: it is to be rescheduled (JobDefer) without using an attempt.
type Closed struct {
	Queue       string
	ID          int64
	JobType     string
	State       correlator.State
	Attempt     int
	ExpiresAt   *time.Time
	TimeWindows []correlator.TimeWindow // nil = the type's
	WindowsErr  error                   // its own windows could not be read
}

// Claim is what one claim statement did.
type Claim struct {
	Jobs   []Claimed // moved to running, in the queue's order
	Closed []Closed  // due but outside their windows: not claimed
	// DBNow is PostgreSQL's clock at the claim (zero when nothing came
	// back); Local, this process's clock just before the claim was asked.
	DBNow, Local time.Time
	// RateFreeAt, on PostgreSQL's clock, is when the earliest full rate
	// window frees (zero: none is full, or all its units are in flight).
	RateFreeAt time.Time
}

// Now estimates PostgreSQL's clock now (see Claimed.DBNow).
func (c *Claim) Now() time.Time { return c.DBNow.Add(time.Since(c.Local)) }

// dueProbeSQL is JobsDue's probe: $1 the queue, $2 the types.
const dueProbeSQL = `/* due probe */ SELECT NOT EXISTS (SELECT 1 FROM hipq_queue p WHERE p.name = $1 AND p.paused)
	AND EXISTS (SELECT 1 FROM unnest($2::text[]) AS t(job_type)
	            WHERE (SELECT j.id FROM hipq_job j WHERE j.queue = $1 AND j.job_type = t.job_type
	                   AND j.state IN ('initial', 'retry') AND j.scheduled_run_time <= now()
	                   AND (j.expires_at IS NULL OR j.expires_at > now())
	                   ORDER BY j.scheduled_run_time LIMIT 1) IS NOT NULL)`

// JobsDue says whether a queue, not paused, has a due job of one of the
// types: waiting (initial or retry), its time come, not expired, whatever
// the queue's limits and the job's windows. Without one a claim of those
// types would claim nothing; with one it may or may not. It costs a tenth
// of a claim that finds nothing, and most wake-ups find nothing: the
// dispatchers are woken several times for each batch the intake claimed
// as it stored it.
//
// One probe of the due index per type, in one round trip: each reads the
// type's range of the index up to now, so a backlog of another type is
// never walked (TestDueReadsSkipOtherTypesBacklog). Sequential scans and sorts
// are off, as in hipq_claim: on statistics taken while a burst waited the
// planner would read the table, and on statistics in which a type was
// rare, every non-final job of that type through the key index, sorted
// (TestDueProbeReadsTheDueIndex).
func (s *Store) JobsDue(ctx context.Context, queue string, types []string) (bool, error) {
	var due bool
	b := &pgx.Batch{}
	b.Queue("BEGIN READ ONLY")
	b.Queue("SET LOCAL enable_seqscan = off")
	b.Queue("SET LOCAL enable_sort = off")
	b.Queue(dueProbeSQL, queue, types).QueryRow(func(r pgx.Row) error {
		return r.Scan(&due)
	})
	b.Queue("COMMIT")
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return false, fmt.Errorf("look for due jobs: %w", err)
	}
	return due, nil
}

// JobClaim moves up to Limit due jobs of one queue to running in one round
// trip (the hipq_claim function): attempt+1, started_at, and a hipq_attempt
// row each, in the queue's order and within its throttle. Jobs past their
// expiry are never claimed; locked rows are skipped, so dispatchers on many
// instances never claim the same job; a throttled queue is claimed by one
// instance at a time, so its limits hold across all of them. A paused queue
// claims nothing.
func (s *Store) JobClaim(ctx context.Context, p JobClaimParams) (Claim, error) {
	typeWindows := map[string]json.RawMessage{}
	for name, ws := range p.TypeWindows {
		if len(ws) == 0 {
			continue
		}
		b, err := json.Marshal(ws)
		if err != nil {
			return Claim{}, fmt.Errorf("claim: time windows of %q: %w", name, err)
		}
		typeWindows[name] = b
	}
	t := p.Throttle
	var (
		sharePath []string
		shareCaps map[string]int
		otherCap  *int
	)
	if t.Shares != nil && t.Limit >= 1 {
		sharePath, shareCaps = t.Shares.Path, t.Shares.Caps
		if t.Shares.OtherCap > 0 {
			otherCap = &t.Shares.OtherCap
		}
	}
	var rates any
	if len(t.Rates) > 0 {
		type rateJSON struct {
			Key   string   `json:"key"`
			Limit int      `json:"limit"`
			Secs  float64  `json:"secs"`
			Type  *string  `json:"type"`
			Path  []string `json:"path"`
		}
		rs := make([]rateJSON, len(t.Rates))
		for i, r := range t.Rates {
			rs[i] = rateJSON{Key: r.Key, Limit: r.Limit, Secs: r.Period.Seconds(), Path: r.Path}
			if r.Type != "" {
				rs[i].Type = &t.Rates[i].Type
			}
		}
		rates = rs
	}
	local := time.Now()
	// now() is the claim transaction's clock, the one started_at holds.
	rows, err := s.pool.Query(ctx, `SELECT c.*, now() FROM hipq_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) c`,
		p.Queue, string(cmp.Or(p.Order, correlator.OrderScheduledFirst)), p.Limit, p.Instance, p.Types, jsonbOrNull(typeWindows), t.Limit, t.Critical,
		jsonbOrNull(t.MaxConcurrency), sharePath, jsonbOrNull(shareCaps), otherCap, rates)
	if err != nil {
		return Claim{}, fmt.Errorf("claim due jobs of queue %q: %w", p.Queue, err)
	}
	var (
		out     = Claim{Local: local}
		c       Claimed
		claimed *bool
		state   string
		windows []byte
		started *time.Time
	)
	// Nothing in a row may keep the claim from being returned once it
	// committed: claimed jobs not returned would hold their throttle
	// slots, unsent, until the sweeper's rescue.
	_, err = pgx.ForEachRow(rows, []any{&claimed, &c.ID, &c.JobType, &c.JobKey, &c.JobData, &state, &c.Attempt,
		&c.MaxAttempts, &c.TimeoutSeconds, &c.ExpiresAt, &windows, &started, &out.DBNow}, func() error {
		ws, werr := decodeWindows(windows) // unreadable windows are taken as open, as the claim takes them
		if werr != nil {
			werr = fmt.Errorf("job %d: time_windows: %w", c.ID, werr)
		}
		if claimed == nil { // the rate windows' wake-up
			if started != nil {
				out.RateFreeAt = *started
			}
			return nil
		}
		if !*claimed {
			out.Closed = append(out.Closed, Closed{Queue: p.Queue, ID: c.ID, JobType: c.JobType, State: correlator.State(state),
				Attempt: c.Attempt, ExpiresAt: c.ExpiresAt, TimeWindows: ws, WindowsErr: werr})
			return nil
		}
		c.Queue, c.TimeWindows, c.WindowsErr, c.StartedAt, c.ClaimedLocal = p.Queue, ws, werr, out.DBNow, local
		if started != nil {
			c.StartedAt = *started
		}
		c.JobData = append(json.RawMessage(nil), c.JobData...)
		out.Jobs = append(out.Jobs, c)
		return nil
	})
	if err != nil {
		// The connection failed while the rows came: whether the claim
		// committed is unknown, so nothing is sent (a claim that did commit
		// is the sweeper's to rescue).
		return Claim{}, fmt.Errorf("claim due jobs of queue %q: %w", p.Queue, err)
	}
	return out, nil
}

// jsonbOrNull passes an empty map as SQL NULL, not as the JSON null.
func jsonbOrNull[V any](m map[string]V) any {
	if len(m) == 0 {
		return nil
	}
	return m
}

// Deferral moves a waiting job found outside its time windows to its next
// opening, or ends it final / expired when that opening is past its expiry.
type Deferral struct {
	Queue   string
	ID      int64
	State   correlator.State // expected: initial or retry
	Attempt int              // expected
	RunAt   time.Time
	Expire  bool
}

// JobDefer applies deferrals in one statement, each guarded by its
// expected state and attempt, and returns how many rows moved. The state
// and attempt stay (a reschedule uses no attempt).
func (s *Store) JobDefer(ctx context.Context, ds []Deferral) (int, error) {
	// Each row is guarded: the queues' statements need no transaction.
	moved := 0
	err := perQueue(ds, func(d Deferral) string { return d.Queue }, func(q string, ds []Deferral) error {
		ids, states, atts := make([]int64, len(ds)), make([]string, len(ds)), make([]int32, len(ds))
		runAt, expire := make([]time.Time, len(ds)), make([]bool, len(ds))
		for i, d := range ds {
			ids[i], states[i], atts[i], runAt[i], expire[i] = d.ID, string(d.State), int32(d.Attempt), d.RunAt, d.Expire
		}
		tag, err := s.pool.Exec(ctx, `
		UPDATE hipq_job j
		SET scheduled_run_time = CASE WHEN u.expire THEN j.scheduled_run_time ELSE u.run_at END,
		    state = CASE WHEN u.expire THEN 'final' ELSE j.state END,
		    outcome = CASE WHEN u.expire THEN 'expired' ELSE j.outcome END,
		    error = CASE WHEN u.expire THEN $6 ELSE j.error END,
		    update_time = now()
		FROM unnest($1::bigint[], $2::text[], $3::int[], $4::timestamptz[], $5::bool[]) AS u(id, state, att, run_at, expire)
		WHERE j.queue = $7 AND j.id = u.id AND j.state = u.state AND j.attempt = u.att AND j.state IN ('initial', 'retry')`,
			ids, states, atts, runAt, expire, correlator.ErrorExpired, q)
		moved += int(tag.RowsAffected())
		return err
	})
	if err != nil {
		return moved, fmt.Errorf("reschedule jobs outside their time windows: %w", err)
	}
	return moved, nil
}

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
		done, err = jobResolveMany(ctx, tx, still)
		return err
	})
	return refsOf(done), err
}

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
		done, err := jobResolveMany(ctx, tx, d.Resolves)
		if err != nil {
			return err
		}
		if err := rateGiveBack(ctx, tx, neverLeft(d.Resolves, done)); err != nil {
			return err
		}
		if len(d.Replies) > 0 {
			if res.Replies, err = applyReplies(ctx, tx, d.Replies, types, 0, time.Time{}); err != nil {
				return err
			}
			if err := deadLettersInsert(ctx, tx, res.Replies.DeadLetters); err != nil {
				return err
			}
		}
		// Then the early replies waiting for the jobs sent (after a reply
		// that came with the send: that one is the answer to this request).
		if len(d.Sent) > 0 {
			if res.Early, _, err = earlyReplyApply(ctx, tx, d.Sent, 0, 0, types); err != nil {
				return err
			}
		}
		return nil
	})
	return res, err
}

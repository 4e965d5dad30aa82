package store

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// ReplyIn is one reply to apply.
type ReplyIn struct {
	Reply *correlator.Reply
	// Queue is the queue of the reply's job when its sender knows it (a
	// reply that came with its send); else its type's is tried first.
	Queue   string
	Kind    string // SourceReply or SourceCallback
	Source  Source
	earlyID int64 // set when it was kept in hipq_early_reply
	// earlyQueue is the queue its row in hipq_early_reply is kept under
	// (set when it is kept, or was read from there).
	earlyQueue string
	expires    time.Time
}

// ReplyBatch is everything one poll of the response consumer commits at
// once.
type ReplyBatch struct {
	Group       string
	Offsets     []OffsetAdvance
	Replies     []ReplyIn
	DeadLetters []DeadLetter // replies that could not be read at all
	EarlyTTL    time.Duration
	// MustWrite: a reply must be applied or move its attempt's deadline (a
	// write of its job and attempt; a reply kept as early writes neither,
	// so it shows nothing of a refusal of those writes), else the batch
	// rolls back and ReplyApply returns ErrNoWrite (see
	// IntakeBatch.MustWrite).
	MustWrite bool
	// Retry, when set, is tried again after the batch's own writes (see
	// IntakeRetry).
	Retry *ReplyRetry
}

// ReplyRetry is the replies a consumer comparing a record PostgreSQL
// refused alone with the records after it tries again (see IntakeRetry):
// Replies and DeadLetters as decoded, Refused their dead letters should
// they be refused again.
type ReplyRetry struct {
	Replies     []ReplyIn
	DeadLetters []DeadLetter
	Refused     []DeadLetter
}

// ReplyResult says what became of each reply of a batch, in input order.
type ReplyResult struct {
	// Verdicts are the replies' verdicts, by index in the batch.
	Verdicts []correlator.Verdict
	// Applied are the replies that ended their attempt, in batch order.
	Applied []AppliedReply
	// Deadlines are the new deadlines progress replies gave, by index in
	// the batch.
	Deadlines map[int]time.Time
	// DeadLetters are the dead letters written: the batch's unreadable
	// replies, then those the verdicts dead-lettered.
	DeadLetters []DeadLetter
	// RefusedAgain is why a Retry was refused again (its Refused were
	// written); nil when it went through (its replies follow the batch's
	// in the indexes above), or there was none.
	RefusedAgain error
}

// AppliedReply is a reply of a batch that ended its attempt.
type AppliedReply struct {
	Index int // in the batch
	AttemptRef
	Res       correlator.Resolution // how the attempt ended
	RoundTrip correlator.RoundTrip  // how long it ran
}

// Counts counts the replies by verdict.
func (r ReplyResult) Counts() map[correlator.Verdict]int {
	n := map[correlator.Verdict]int{}
	for _, v := range r.Verdicts {
		n[v]++
	}
	return n
}

// RoundTrips are the round trips of the attempts the replies ended.
func (r ReplyResult) RoundTrips() []correlator.RoundTrip {
	if len(r.Applied) == 0 {
		return nil
	}
	out := make([]correlator.RoundTrip, len(r.Applied))
	for i, a := range r.Applied {
		out[i] = a.RoundTrip
	}
	return out
}

// Merge adds what another batch, whose replies follow r's, did to r.
func (r *ReplyResult) Merge(o ReplyResult) {
	shift := len(r.Verdicts) // o's indexes count from the first of its replies
	r.Verdicts = append(r.Verdicts, o.Verdicts...)
	for _, a := range o.Applied {
		a.Index += shift
		r.Applied = append(r.Applied, a)
	}
	for i, d := range o.Deadlines {
		if r.Deadlines == nil {
			r.Deadlines = map[int]time.Time{}
		}
		r.Deadlines[i+shift] = d
	}
	r.DeadLetters = append(r.DeadLetters, o.DeadLetters...)
}

// ReplyApply applies a batch of replies (SPEC §6) in one transaction with
// the offsets compare-and-set.
func (s *Store) ReplyApply(ctx context.Context, b ReplyBatch, types correlator.Types) (ReplyResult, error) {
	var res ReplyResult
	var now time.Time
	open := func(pb *pgx.Batch) error {
		offsetsAdvance(pb, b.Group, b.Offsets)
		pb.Queue(`SELECT now()`).QueryRow(func(row pgx.Row) error { return row.Scan(&now) }) // (see applyReplies)
		return nil
	}
	err := s.inTxOpen(ctx, open, func(tx pgx.Tx) error {
		var err error
		res, err = applyReplies(ctx, tx, s.events, b.Replies, types, b.EarlyTTL, now)
		if err != nil {
			return err
		}
		// (The batch's replies are all fresh: one decided early is kept.)
		if n := res.Counts(); b.MustWrite && n[correlator.Apply]+n[correlator.Progressed] == 0 {
			return ErrNoWrite
		}
		res.DeadLetters = append(append([]DeadLetter(nil), b.DeadLetters...), res.DeadLetters...)
		if err := deadLettersInsert(ctx, tx, res.DeadLetters); err != nil || b.Retry == nil {
			return err
		}
		return replyRetry(ctx, tx, s.events, b.Retry, types, b.EarlyTTL, now, &res)
	})
	return res, err
}

// replyRetry writes r (see ReplyRetry) and adds what it did to res.
func replyRetry(ctx context.Context, tx pgx.Tx, ev *Events, r *ReplyRetry, types correlator.Types, earlyTTL time.Duration, now time.Time,
	res *ReplyResult) error {
	var again ReplyResult
	refused, err := tryAgain(ctx, tx, func(tx pgx.Tx) error {
		var err error
		if again, err = applyReplies(ctx, tx, ev, r.Replies, types, earlyTTL, now); err != nil {
			return err
		}
		again.DeadLetters = append(append([]DeadLetter(nil), r.DeadLetters...), again.DeadLetters...)
		return deadLettersInsert(ctx, tx, again.DeadLetters)
	}, r.Refused)
	if err != nil || refused != nil {
		res.RefusedAgain = refused
		res.DeadLetters = append(res.DeadLetters, r.Refused...)
		return err
	}
	res.Merge(again)
	return nil
}

// applyReplies decides a batch of replies in one call to the domain
// (correlator.DecideReplies) against their rows, read and locked in id
// order, on the database's clock, and writes every decision: outcomes,
// early replies kept and used up, and (returned, not written) dead
// letters. now is the database's clock in tx (now()), or zero: then it
// is read here.
func applyReplies(ctx context.Context, tx pgx.Tx, ev *Events, ins []ReplyIn, types correlator.Types, earlyTTL time.Duration, now time.Time) (ReplyResult, error) {
	res := ReplyResult{Verdicts: make([]correlator.Verdict, len(ins))}
	if len(ins) == 0 {
		return res, nil
	}
	targets, err := lockTargets(ctx, tx, ins, types)
	if err != nil {
		return res, err
	}
	// One clock: retries are scheduled, and early replies expire, on
	// PostgreSQL's, which the claim and the sweeper read too.
	if now.IsZero() {
		if err := tx.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
			return res, fmt.Errorf("read the database clock: %w", err)
		}
	}
	batch := make([]correlator.Pending, len(ins))
	for i, in := range ins {
		batch[i] = correlator.Pending{Reply: in.Reply, Kept: in.earlyID != 0, KeptUntil: in.expires}
	}
	if err := progressDeadlines(ctx, tx, ins, targets); err != nil {
		return res, err
	}
	resolves := make([]Resolve, 0, len(ins))
	res.Applied = make([]AppliedReply, 0, len(ins)) // (most replies apply)
	var early []ReplyIn
	var drop []ReplyIn // early rows used up
	var news []progressNews
	for i, d := range correlator.DecideReplies(batch, targets, types, now, earlyTTL) {
		in := ins[i]
		res.Verdicts[i] = d.Verdict
		switch {
		case d.Verdict == correlator.Apply:
			ref := AttemptRef{Queue: d.Target.Queue, JobID: d.Target.ID, Attempt: d.Target.Attempt}
			resolves = append(resolves, Resolve{Queue: ref.Queue, JobID: ref.JobID, Attempt: ref.Attempt, Reply: in.Reply.Result,
				ResultIsReply: true, Res: d.Res})
			res.Applied = append(res.Applied, AppliedReply{Index: i, AttemptRef: ref, Res: d.Res})
		case d.Verdict == correlator.Progressed:
			news = append(news, progressNews{AttemptRef{Queue: d.Target.Queue, JobID: d.Target.ID, Attempt: d.Target.Attempt}, d.Deadline, in.Reply.Result})
			if res.Deadlines == nil {
				res.Deadlines = map[int]time.Time{}
			}
			res.Deadlines[i] = d.Deadline
		case d.Verdict == correlator.DeadLetter:
			res.DeadLetters = append(res.DeadLetters, DeadLetter{Kind: in.Kind, Source: in.Source, Reason: d.Reason.Error()})
		case !d.KeepUntil.IsZero():
			in.expires, in.earlyQueue = d.KeepUntil, earlyQueueOf(in, d.Target, types)
			early = append(early, in)
		}
		if d.Drop {
			drop = append(drop, in)
		}
	}
	done, err := jobResolveMany(ctx, tx, ev, resolves)
	if err != nil {
		return res, err
	}
	// The writes come back grouped by queue, in no set order: matched by
	// attempt (a batch applies at most one reply per job).
	trips := make(map[AttemptRef]correlator.RoundTrip, len(done))
	for _, d := range done {
		trips[d.AttemptRef] = d.RoundTrip
	}
	for i, a := range res.Applied {
		rt, ok := trips[a.AttemptRef]
		if !ok {
			// Rows are locked, so this cannot happen; refuse to commit if it does.
			return res, fmt.Errorf("apply replies: %d of %d guarded writes took effect", len(done), len(resolves))
		}
		res.Applied[i].RoundTrip = rt
	}
	if err := progressWrite(ctx, tx, news); err != nil {
		return res, err
	}
	if err := earlyInsert(ctx, tx, early); err != nil {
		return res, err
	}
	if err := earlyDelete(ctx, tx, drop); err != nil {
		return res, err
	}
	return res, nil
}

// lockTargetsSQL is lockTargets' statement: the jobs of one queue ($4)
// of ids $1 and the non-final jobs of (type, key) pairs $2, $3, locked in
// id order. The ids are collected first (an array the statement computes
// once), and the jobs read by that array: by primary key, or, on a stale
// plan, by one scan comparing each row with it. Joined instead, a table
// never analyzed would be scanned and matched against a materialized
// batch for each of its rows (TestPlansOfEmptyTablesStayLinear).
const lockTargetsSQL = `
		SELECT id, job_type, job_key, state, attempt, max_attempts, expires_at, time_windows,
		       coalesce(started_at, 'epoch'), timeout_seconds
		FROM hipq_job
		WHERE queue = $4
		  AND id = ANY (ARRAY(
		             SELECT unnest($1::bigint[])
		             UNION ALL
		             -- each key probed (OFFSET 0: never a walk of every
		             -- non-final job, whatever the statistics say)
		             SELECT x.id FROM unnest($2::text[], $3::text[]) AS k(t, k)
		             CROSS JOIN LATERAL (SELECT j.id FROM hipq_job j
		                                 WHERE j.queue = $4 AND j.job_type = k.t AND j.job_key = k.k AND j.state <> 'final'
		                                 OFFSET 0) x))
		ORDER BY id
		FOR UPDATE`

// findQueuesSQL finds, in every queue, the queues of jobs of ids $1 and
// of the non-final jobs of (type, key) pairs $2, $3 (a read: it locks
// nothing).
const findQueuesSQL = `
		SELECT j.queue, j.id FROM hipq_job j WHERE j.id = ANY($1)
		UNION ALL
		SELECT x.queue, x.id FROM unnest($2::text[], $3::text[]) AS k(t, k)
		CROSS JOIN LATERAL (SELECT j.queue, j.id FROM hipq_job j
		                    WHERE j.job_type = k.t AND j.job_key = k.k AND j.state <> 'final' OFFSET 0) x`

// findQueuesCitusSQL is findQueuesSQL on Citus, which runs a lateral
// subquery over a distributed table only when it names one shard: the
// keys are joined, in every shard, each of which reads its own jobs.
const findQueuesCitusSQL = `
		SELECT j.queue, j.id FROM hipq_job j WHERE j.id = ANY($1)
		UNION ALL
		SELECT j.queue, j.id FROM hipq_job j JOIN unnest($2::text[], $3::text[]) AS k(t, k) ON j.job_type = k.t AND j.job_key = k.k
		WHERE j.state <> 'final'`

// replyWants are the rows replies look for in one queue: by job id, or
// the non-final job of a (type, key).
type replyWants struct {
	ids         []int64
	types, keys []string
}

func (w *replyWants) empty() bool { return len(w.ids)+len(w.types) == 0 }

func (w *replyWants) add(r *correlator.Reply) {
	if r.JobID != nil {
		w.ids = append(w.ids, *r.JobID)
	} else {
		w.types, w.keys = append(w.types, r.JobType), append(w.keys, r.JobKey)
	}
}

// lockTargets reads and locks the rows the replies name: by job id, else
// the non-final job of (type, key); and finds which (type, key) without a
// non-final job have a final one. Each queue's rows are locked by a
// statement naming it, queues in order and rows in id order. A reply's
// queue is the one its sender knew, else its type's here; the replies
// whose job is not there (a job id alone, a type not configured here, a
// type whose queue changed while its jobs ran) are looked for in every
// queue, then locked in theirs.
func lockTargets(ctx context.Context, tx pgx.Tx, ins []ReplyIn, types correlator.Types) (correlator.Targets, error) {
	t := correlator.Targets{ByID: map[int64]*correlator.Target{}, ByKey: map[correlator.TypeKey]*correlator.Target{},
		Finals: map[correlator.TypeKey]bool{}}
	wants := map[string]*replyWants{}
	var unplaced replyWants
	placed := make([]bool, len(ins))
	for i, in := range ins {
		q := in.Queue
		if jt := types.Get(in.Reply.JobType); q == "" && in.Reply.JobType != "" && jt != nil {
			q = jt.Queue
		}
		if q == "" {
			unplaced.add(in.Reply)
			continue
		}
		if wants[q] == nil {
			wants[q] = &replyWants{}
		}
		wants[q].add(in.Reply)
		placed[i] = true
	}
	// The replies whose queue nobody here knows (a job id alone, a type
	// not configured here) are found by a read first, so that every row is
	// locked in one pass, in (queue, id) order.
	if !unplaced.empty() {
		found, err := findQueues(ctx, tx, unplaced)
		if err != nil {
			return t, err
		}
		for q, w := range found {
			if wants[q] == nil {
				wants[q] = &replyWants{}
			}
			wants[q].ids = append(wants[q].ids, w.ids...)
		}
	}
	if err := lockIn(ctx, tx, wants, t); err != nil {
		return t, err
	}
	// A reply by key that found no job in its type's queue: early, late,
	// or its type moved to another queue while its job ran. Only the last
	// finds a row here; it is locked after the others, out of (queue, id)
	// order: a deadlock with another writer is then possible, and retried
	// whole.
	var misses replyWants
	for i, in := range ins {
		if placed[i] && t.Of(in.Reply) == nil {
			misses.add(in.Reply)
		}
	}
	if !misses.empty() {
		found, err := findQueues(ctx, tx, misses)
		if err != nil {
			return t, err
		}
		if err := lockIn(ctx, tx, found, t); err != nil {
			return t, err
		}
	}
	var ft, fk []string
	for _, in := range ins {
		tk := correlator.TypeKey{Type: in.Reply.JobType, Key: in.Reply.JobKey}
		if in.Reply.JobID == nil && t.ByKey[tk] == nil {
			ft, fk = append(ft, tk.Type), append(fk, tk.Key)
		}
	}
	if len(ft) > 0 {
		rows, err := tx.Query(ctx, `
			SELECT DISTINCT j.job_type, j.job_key FROM hipq_job j
			JOIN unnest($1::text[], $2::text[]) AS k(t, k) ON j.job_type = k.t AND j.job_key = k.k
			WHERE j.state = 'final'`, ft, fk)
		if err != nil {
			return correlator.Targets{}, fmt.Errorf("find final jobs: %w", err)
		}
		var tk correlator.TypeKey
		if _, err := pgx.ForEachRow(rows, []any{&tk.Type, &tk.Key}, func() error { t.Finals[tk] = true; return nil }); err != nil {
			return correlator.Targets{}, fmt.Errorf("find final jobs: %w", err)
		}
	}
	return t, nil
}

// lockIn locks, queue by queue in order, the rows each queue's replies
// want, into t.
func lockIn(ctx context.Context, tx pgx.Tx, wants map[string]*replyWants, t correlator.Targets) error {
	for _, q := range slices.Sorted(maps.Keys(wants)) {
		w := wants[q]
		rows, err := tx.Query(ctx, lockTargetsSQL, w.ids, w.types, w.keys, q)
		if err != nil {
			return fmt.Errorf("lock reply targets: %w", err)
		}
		var (
			row     = correlator.Target{Queue: q}
			state   string
			windows []byte
			timeout int
		)
		_, err = pgx.ForEachRow(rows, []any{&row.ID, &row.JobType, &row.JobKey, &state, &row.Attempt, &row.MaxAttempts, &row.ExpiresAt, &windows,
			&row.StartedAt, &timeout}, func() error {
			tg := row
			tg.Timeout = time.Duration(timeout) * time.Second
			tg.State = correlator.State(state)
			// Windows this build cannot read are left out of the retry's
			// schedule (the claim still applies them): a reply to such a job
			// is applied, never refused for it.
			tg.Windows, _ = decodeWindows(windows)
			t.ByID[tg.ID] = &tg
			if tg.State != correlator.StateFinal {
				t.ByKey[correlator.TypeKey{Type: tg.JobType, Key: tg.JobKey}] = &tg
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("lock reply targets: %w", err)
		}
	}
	return nil
}

// findQueues finds in which queues the rows w wants are (a read over
// every queue: it locks nothing).
func findQueues(ctx context.Context, tx pgx.Tx, w replyWants) (map[string]*replyWants, error) {
	q := findQueuesSQL
	if distributedTx(tx) {
		q = findQueuesCitusSQL
	}
	rows, err := tx.Query(ctx, q, w.ids, w.types, w.keys)
	if err != nil {
		return nil, fmt.Errorf("find reply targets: %w", err)
	}
	found := map[string]*replyWants{}
	var id int64
	_, err = pgx.ForEachRow(rows, []any{&q, &id}, func() error {
		if found[q] == nil {
			found[q] = &replyWants{}
		}
		// By id: the row found, whichever reply named it.
		found[q].ids = append(found[q].ids, id)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("find reply targets: %w", err)
	}
	return found, nil
}

// progressNews is what a progress reply writes on its attempt.
type progressNews struct {
	AttemptRef
	Deadline time.Time
	Progress json.RawMessage
}

// progressDeadlines reads the deadlines of the running attempts that
// progress replies of the batch name (their rows are locked): only a batch
// with progress replies pays for it.
func progressDeadlines(ctx context.Context, tx pgx.Tx, ins []ReplyIn, t correlator.Targets) error {
	var refs []AttemptRef
	for _, in := range ins {
		if !in.Reply.Progress {
			continue
		}
		if tg := t.Of(in.Reply); tg != nil && tg.State == correlator.StateRunning {
			refs = append(refs, AttemptRef{Queue: tg.Queue, JobID: tg.ID, Attempt: tg.Attempt})
		}
	}
	err := perQueue(refs, refQueue, func(q string, refs []AttemptRef) error {
		ids, atts := refArrays(refs)
		rows, err := tx.Query(ctx, attemptDeadlinesSQL, q, ids, atts)
		if err != nil {
			return err
		}
		var id int64
		var d time.Time
		_, err = pgx.ForEachRow(rows, []any{&id, &d}, func() error {
			t.ByID[id].Deadline = d
			return nil
		})
		return err
	})
	if err != nil {
		return fmt.Errorf("read attempt deadlines: %w", err)
	}
	return nil
}

// attemptDeadlinesSQL reads the deadlines of attempts of one queue ($1)
// by job id and attempt ($2, $3). (The queue, as in attemptTracesSQL.)
const attemptDeadlinesSQL = `
	SELECT a.job_id, a.deadline FROM hipq_attempt a JOIN unnest($2::bigint[], $3::int[]) AS k(id, att)
	  ON a.job_id = k.id AND a.attempt = k.att
	WHERE a.queue = $1 AND a.deadline IS NOT NULL`

// progressWrite records news on each attempt: its new deadline (the later
// of the one it had and the given one, applied in order) and the progress
// payload. Guarded by the job's state and attempt.
func progressWrite(ctx context.Context, tx pgx.Tx, news []progressNews) error {
	// Of several news for one attempt in the batch, the last one's
	// payload and the latest deadline stay.
	err := perQueue(news, func(p progressNews) string { return p.Queue }, func(q string, news []progressNews) error {
		n := len(news)
		ids, atts, deadlines, progress := make([]int64, n), make([]int32, n), make([]time.Time, n), make([]string, n)
		for i, p := range news {
			ids[i], atts[i], deadlines[i] = p.JobID, int32(p.Attempt), p.Deadline
			progress[i] = string(p.Progress)
			if progress[i] == "" {
				progress[i] = "null"
			}
		}
		_, err := tx.Exec(ctx, `
		UPDATE hipq_attempt a SET deadline = greatest(a.deadline, u.deadline), progress = u.progress, progress_at = now()
		FROM (SELECT DISTINCT ON (id, att) id, att, max(deadline) OVER (PARTITION BY id, att) AS deadline, progress
		      FROM unnest($1::bigint[], $2::int[], $3::timestamptz[], $4::jsonb[]) WITH ORDINALITY AS n(id, att, deadline, progress, ord)
		      ORDER BY id, att, ord DESC) u
		JOIN hipq_job j ON j.queue = $5 AND j.id = u.id AND j.attempt = u.att AND j.state = 'running'
		WHERE a.queue = $5 AND a.job_id = u.id AND a.attempt = u.att`, ids, atts, deadlines, progress, q)
		return err
	})
	if err != nil {
		return fmt.Errorf("record progress: %w", err)
	}
	return nil
}

package store

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// IntakeJob is a new job with the record it came from.
type IntakeJob struct {
	Job    *correlator.Job
	Source Source
	Kind   string // the dead letter's source should it conflict; empty: SourceIntake
	// Claim asks for the job to be claimed as it is stored, for the
	// batch's Instance to send (its dispatcher has room, the queue no
	// limits, the type no windows and a neighbour that takes sends): it
	// is, if it is due and not expired, has no time windows of its own,
	// and its queue is not paused and has no due job waiting (which would
	// come first), and, in a queue with limits (IntakeBatch.Limits), when
	// the claim's plan takes it. Otherwise it is stored waiting, as any job.
	Claim bool
	// units are the rate windows the intake's claim plan counts the job
	// under (a queue with rates).
	units []correlator.RateWindow
}

// IntakeLimits are the limits of a queue whose new jobs the intake claims
// as it stores them.
type IntakeLimits struct {
	Throttle correlator.Throttle
	Order    correlator.Order
}

// IntakeBatch is everything one poll of the intake consumer commits at once.
type IntakeBatch struct {
	Group       string
	Offsets     []OffsetAdvance
	Jobs        []IntakeJob // unique per (type, key): the caller reduces first
	DeadLetters []DeadLetter
	Instance    string // of the claims (IntakeJob.Claim), recorded on their attempts
	// MustWrite: the batch must insert a job, else it rolls back and
	// IntakeApply returns ErrNoWrite (a consumer comparing a refused
	// record with the records after it needs one that meets the write).
	MustWrite bool
	// Retry, when set, is tried again after the batch's own writes (see
	// Retry).
	Retry *IntakeRetry
	// Limits holds the limits of each queue whose jobs ask to be claimed
	// (the zero Throttle: none). In a queue with limits
	// (correlator.Throttle.Bounded) the batch takes the queue's claim lock
	// as it begins, reads what counts against its limits as a claim does,
	// and claims only the jobs correlator.PlanClaim takes, in the queue's
	// order. A job of a queue not listed is stored waiting, whatever its
	// Claim.
	Limits map[string]IntakeLimits
}

// IntakeRetry is what a consumer comparing a record PostgreSQL refused
// alone with the records after it (MustWrite) tries again once they are
// written, in the same transaction: the refused records as decoded, jobs
// (never claimed as stored) and dead letters. Tried after the records
// after them went through, they meet what those met: should the refusal
// have stopped meanwhile (a privilege granted back between the two
// tries), they are written now, as if never refused; refused again, the
// refusal is theirs alone, and Refused, their dead letters, are written
// instead (under a savepoint rolled back, so nothing of them remains).
type IntakeRetry struct {
	Jobs        []IntakeJob
	DeadLetters []DeadLetter
	Duplicates  int // found before: counted in IntakeResult.Duplicates if they go through
	Refused     []DeadLetter
}

// ErrNoWrite: a batch that had to write more than dead letters (MustWrite)
// made no job and applied no reply; it rolled back, nothing changed.
var ErrNoWrite = errors.New("the batch wrote no job and applied no reply")

// IntakeResult says what the batch did.
type IntakeResult struct {
	Inserted    int
	Duplicates  int          // a non-final job with the same job_data existed
	DeadLetters []DeadLetter // the batch's own plus conflicts found here
	// RefusedAgain is why a Retry was refused again (its Refused were
	// written); nil when it went through, or there was none.
	RefusedAgain error
	// Claimed are the jobs claimed as they were stored (IntakeJob.Claim):
	// running, attempt 1, their attempt rows written. Once the batch has
	// committed they are the Instance's to send; if it never does, the
	// sweeper's rescue undoes them as any claim never sent.
	Claimed []Claimed
}

// IntakeApply writes a batch of intake records in one transaction: the
// offsets compare-and-set, the new jobs (a record for a (type, key) with a
// non-final job is a duplicate, or a conflict when its job_data differs),
// and the dead letters. It returns ErrOffsetConflict, writing nothing, when
// another consumer applied these records first.
func (s *Store) IntakeApply(ctx context.Context, b IntakeBatch) (IntakeResult, error) {
	var res IntakeResult
	// This process's clock before the transaction began, whose start is
	// the claims' started_at: time.Since(local) bounds from above how long
	// ago they were made (Claimed.ClaimedLocal).
	local := time.Now()
	if s.dist {
		// On Citus no job is claimed as it is stored (jobsInsertDistributed):
		// they wait for their dispatchers' claims.
		b.Limits = nil
		b.Jobs = slices.Clone(b.Jobs)
		for i := range b.Jobs {
			b.Jobs[i].Claim = false
		}
	}
	limited := intakeLimited(b)
	open := func(pb *pgx.Batch) error {
		offsetsAdvance(pb, b.Group, b.Offsets)
		for _, l := range limited {
			l.read(pb, b.Jobs)
		}
		return nil
	}
	unlisted := slices.ContainsFunc(b.Jobs, func(ij IntakeJob) bool {
		_, listed := b.Limits[ij.Job.Queue]
		return ij.Claim && !listed
	})
	err := s.inTxOpen(ctx, open, func(tx pgx.Tx) error {
		jobs := b.Jobs
		if len(limited) > 0 || unlisted {
			jobs = slices.Clone(b.Jobs)
			for i := range jobs {
				if _, listed := b.Limits[jobs[i].Job.Queue]; !listed {
					jobs[i].Claim = false
				}
			}
			for _, l := range limited {
				if err := l.plan(jobs); err != nil {
					return err
				}
			}
		}
		var err error
		res, err = intakeWrite(ctx, tx, jobs, b.DeadLetters, b.Instance)
		if err == nil && b.MustWrite && res.Inserted == 0 {
			err = ErrNoWrite
		}
		if err == nil && b.Retry != nil {
			err = intakeRetry(ctx, tx, b.Retry, &res)
		}
		return err
	})
	for i := range res.Claimed {
		res.Claimed[i].ClaimedLocal = local
	}
	return res, err
}

// intakeWrite writes new jobs and dead letters: a job whose (type, key)
// has a non-final job is a duplicate, or a conflict (dead-lettered, of the
// job's Kind) when its job_data differs.
func intakeWrite(ctx context.Context, tx pgx.Tx, jobs []IntakeJob, dls []DeadLetter, instance string) (IntakeResult, error) {
	res := IntakeResult{DeadLetters: append([]DeadLetter(nil), dls...)}
	var conflicts []IntakeJob
	var err error
	if res.Inserted, res.Duplicates, conflicts, res.Claimed, err = jobsAccept(ctx, tx, jobs, instance); err != nil {
		return res, err
	}
	for _, ij := range conflicts {
		kind := ij.Kind
		if kind == "" {
			kind = SourceIntake
		}
		res.DeadLetters = append(res.DeadLetters, DeadLetter{Kind: kind, Source: ij.Source,
			Reason: correlator.CodeConflict + ": a non-final job with this job_type and job_key has other job_data"})
	}
	return res, deadLettersInsert(ctx, tx, res.DeadLetters)
}

// intakeRetry writes r (see IntakeRetry) and adds what it did to res.
func intakeRetry(ctx context.Context, tx pgx.Tx, r *IntakeRetry, res *IntakeResult) error {
	jobs := make([]IntakeJob, len(r.Jobs))
	for i, ij := range r.Jobs {
		ij.Claim = false
		jobs[i] = ij
	}
	var again IntakeResult
	refused, err := tryAgain(ctx, tx, func(tx pgx.Tx) error {
		var err error
		again, err = intakeWrite(ctx, tx, jobs, r.DeadLetters, "")
		return err
	}, r.Refused)
	if err != nil || refused != nil {
		res.RefusedAgain = refused
		res.DeadLetters = append(res.DeadLetters, r.Refused...)
		return err
	}
	res.Inserted += again.Inserted
	res.Duplicates += again.Duplicates + r.Duplicates
	res.DeadLetters = append(res.DeadLetters, again.DeadLetters...)
	return nil
}

// jobsAccept inserts jobs as intake does: a job whose (type, key) has a
// non-final job already is a duplicate when their job_data agree, else a
// conflict, returned for the caller to refuse. Each job is decided by one
// statement, on one snapshot: whether it was inserted and, if not, what the
// non-final job in its way holds, so a job going final meanwhile can never
// turn a conflict into a duplicate. A job whose insert met a row the
// statement's snapshot does not show (committed by another writer while it
// ran) is decided by the next statement.
func jobsAccept(ctx context.Context, tx pgx.Tx, jobs []IntakeJob, instance string) (inserted, duplicates int, conflicts []IntakeJob,
	claimed []Claimed, err error) {
	pending := jobs
	for try := 0; len(pending) > 0; try++ {
		if try == 10 {
			return 0, 0, nil, nil, fmt.Errorf("insert jobs: %d jobs met rows committed under the insert ten times: %w", len(pending), errRaced)
		}
		var st []acceptStatus
		var cs []Claimed
		var err error
		if distributedTx(tx) {
			st, err = jobsInsertDistributed(ctx, tx, pending)
		} else {
			st, cs, err = jobsInsert(ctx, tx, pending, instance)
		}
		if err != nil {
			return 0, 0, nil, nil, err
		}
		claimed = append(claimed, cs...)
		var again []IntakeJob
		for i, ij := range pending {
			switch st[i] {
			case acceptInserted:
				inserted++
			case acceptDuplicate:
				duplicates++
			case acceptConflict:
				conflicts = append(conflicts, ij)
			default:
				again = append(again, ij)
			}
		}
		pending = again
	}
	return inserted, duplicates, conflicts, claimed, nil
}

// JobsInsert inserts jobs outside a consumer batch (tests, tools): those
// whose (type, key) has a non-final job are left out. It returns how many
// were inserted.
func (s *Store) JobsInsert(ctx context.Context, jobs []*correlator.Job) (int, error) {
	ij := make([]IntakeJob, len(jobs))
	for i, j := range jobs {
		ij[i].Job = j
	}
	var n int
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		var err error
		n, _, _, _, err = jobsAccept(ctx, tx, ij, "")
		return err
	})
	return n, err
}

// What one insert statement made of a job.
type acceptStatus int

const (
	acceptUndecided acceptStatus = iota // met a row its snapshot does not show
	acceptInserted
	acceptDuplicate // a non-final job with the same job_data
	acceptConflict  // a non-final job with other job_data
)

// scheduled is a job's scheduled_run_time; nil (due at once) when it is
// zero, for the insert to take the database's now(): one clock, the one
// the claim reads.
func scheduled(j *correlator.Job) *time.Time {
	if j.ScheduledRunTime.IsZero() {
		return nil
	}
	t := j.ScheduledRunTime
	return &t
}

// jobsInsert inserts jobs (unique per (type, key)) in one statement and
// says, on that statement's snapshot, what became of each. Jobs that ask
// to be claimed (IntakeJob.Claim) and may be are stored running, attempt
// 1, with their attempt rows, as a claim stores them (claimable as the
// job alone decides, correlator.Job.ClaimableAtIntake; still due on
// PostgreSQL's clock; their queue not paused and without a due job
// waiting), and returned: one write of the row instead of an insert and a
// claim.
func jobsInsert(ctx context.Context, tx pgx.Tx, jobs []IntakeJob, instance string) ([]acceptStatus, []Claimed, error) {
	if len(jobs) == 0 {
		return nil, nil, nil
	}
	n := len(jobs)
	c := intakeColumnsOf(jobs, time.Now())
	queues, types, keys, data := c.queues, c.types, c.keys, c.data
	maxAtt, prio, factor, timeout := c.maxAtt, c.prio, c.factor, c.timeout
	sched, expires, windows := c.sched, c.expires, c.windows
	tparents, tstates, replyTo, correlation := c.tparents, c.tstates, c.replyTo, c.correlation
	claim, claiming := c.claim, c.claiming
	unitRates, unitParts, unitOrds := c.unitRates, c.unitParts, c.unitOrds
	var b pgx.Batch // (one round trip for all it holds)
	q := "/* stores */"
	if claiming {
		// The probe of each queue's due jobs reads the due index, whatever
		// statistics say (taken while the table was empty, they would have
		// it read the table): as the claim does, no sequential scans for
		// the rest of this transaction. And a text of its own (the
		// comment): its cached plans are made with sequential scans off,
		// never one made without.
		b.Queue("SET LOCAL enable_seqscan = off")
		q = "/* stores and claims */"
	}
	units, args := "", []any{}
	if len(unitOrds) > 0 {
		// The rate units of the jobs claimed in a queue with rates, as a
		// claim writes them (claimWriteSQL): one per window, claimed_at
		// the attempts' dispatched_at.
		units, args = `, units AS (
		  INSERT INTO hipq_rate_unit (queue, claimed_at, rate, part, job_ids, attempts, n)
		  SELECT i.queue, now(), u.rate, u.part, array_agg(i.id), array_agg(1), count(*)
		  FROM unnest($18::text[], $19::text[], $20::bigint[]) AS u(rate, part, ord)
		  JOIN n ON n.ord = u.ord
		  JOIN ins i ON i.job_type = n.job_type AND i.job_key = n.job_key AND i.state = 'running'
		  GROUP BY i.queue, u.rate, u.part
		  RETURNING queue, rate, part, n
		), `+rateCountsCTE, []any{unitRates, unitParts, unitOrds}
	}
	insert := b.Queue(q+`
		WITH n AS (
		  SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::int[], $6::int[], $7::int[],
		                       $8::int[], $9::timestamptz[], $10::timestamptz[], $11::jsonb[], $12::text[], $13::text[],
		                       $14::bool[], $16::text[], $17::jsonb[]) WITH ORDINALITY
		    AS n(queue, job_type, job_key, job_data, max_attempts, priority, throttle_factor, timeout_seconds,
		         scheduled_run_time, expires_at, time_windows, trace_parent, trace_state, claim, reply_to, correlation, ord)
		), open AS (
		  -- The queues whose new due jobs may be claimed as they are
		  -- stored: not paused, and no due job waiting, which comes first.
		  -- The types with waiting jobs in the queue (a skip scan of the
		  -- due index, one probe per type), then one probe of each type's
		  -- range of the due index up to now: never a walk of waiting
		  -- jobs, a day ahead or not.
		  SELECT q.queue FROM (SELECT DISTINCT queue FROM n WHERE n.claim) q
		  WHERE NOT EXISTS (SELECT 1 FROM hipq_queue p WHERE p.name = q.queue AND p.paused)
		    AND NOT EXISTS (
		      WITH RECURSIVE t(job_type) AS (
		        (SELECT j.job_type FROM hipq_job j WHERE j.queue = q.queue AND j.state IN ('initial', 'retry')
		         ORDER BY j.job_type LIMIT 1)
		        UNION ALL
		        SELECT (SELECT j.job_type FROM hipq_job j WHERE j.queue = q.queue AND j.state IN ('initial', 'retry')
		                  AND j.job_type > t.job_type ORDER BY j.job_type LIMIT 1)
		        FROM t WHERE t.job_type IS NOT NULL
		      )
		      SELECT 1 FROM t WHERE t.job_type IS NOT NULL
		        -- (a scalar subquery with LIMIT 1: a probe per type, never
		        -- a join that reads every due job)
		        AND (SELECT j.id FROM hipq_job j WHERE j.queue = q.queue AND j.job_type = t.job_type AND `+dueSQL+`
		             -- (in time order: the type's range of the due index by
		             -- time, never the one by priority, which holds its waiting
		             -- jobs, a day ahead or not, before its due ones)
		             ORDER BY j.scheduled_run_time LIMIT 1) IS NOT NULL)
		), m AS (
		  -- (Claimable as far as the job alone decides, by this process's
		  -- clock: claim; still due by PostgreSQL's.)
		  SELECT n.*, coalesce(n.claim, false) AND n.queue IN (SELECT queue FROM open)
		              AND (SELECT `+dueTimeSQL+` FROM (SELECT coalesce(n.scheduled_run_time, now()) AS scheduled_run_time, n.expires_at) j) AS run
		  FROM n
		), ins AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, job_data, max_attempts, priority, throttle_factor,
		                        timeout_seconds, scheduled_run_time, expires_at, time_windows, trace_parent, trace_state,
		                        reply_to, correlation, state, attempt, started_at)
		  SELECT queue, job_type, job_key, job_data, max_attempts, priority, throttle_factor, timeout_seconds,
		         coalesce(scheduled_run_time, now()), expires_at, time_windows, trace_parent, trace_state, reply_to, correlation,
		         CASE WHEN run THEN 'running' ELSE 'initial' END, CASE WHEN run THEN 1 ELSE 0 END, CASE WHEN run THEN now() END
		  FROM m
		  ON CONFLICT (job_type, job_key) WHERE state <> 'final' DO NOTHING
		  RETURNING id, queue, job_type, job_key, state, started_at, job_data
		), att AS (
		  INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at)
		  SELECT queue, id, 1, $15, started_at FROM ins WHERE state = 'running'
		)`+units+`, notify AS (
		  SELECT pg_notify('`+channelJobReady+`', q) FROM (SELECT DISTINCT queue AS q FROM ins WHERE state <> 'running') d
		)
		SELECT n.ord, CASE WHEN i.job_key IS NOT NULL THEN 1
		            -- Only a job not inserted looks for the one in its way.
		            ELSE coalesce((SELECT CASE WHEN j.job_data = n.job_data THEN 2 ELSE 3 END FROM hipq_job j
		                           WHERE j.job_type = n.job_type AND j.job_key = n.job_key AND j.state <> 'final'), 0) END,
		       CASE WHEN i.state = 'running' THEN i.id END, CASE WHEN i.state = 'running' THEN i.started_at END,
		       -- As the claim returns it: the stored jsonb, not the bytes
		       -- that came (every attempt sends the same request).
		       CASE WHEN i.state = 'running' THEN i.job_data END
		FROM n
		LEFT JOIN ins i ON i.job_type = n.job_type AND i.job_key = n.job_key
		WHERE (SELECT count(*) FROM notify) >= 0`,
		append([]any{queues, types, keys, data, maxAtt, prio, factor, timeout, sched, expires, windows, tparents, tstates, claim,
			instance, replyTo, correlation}, args...)...)
	out := make([]acceptStatus, n)
	var claimed []Claimed
	if claiming {
		claimed = make([]Claimed, 0, n)
	}
	var ord int64
	var st, got int
	var id *int64
	var started *time.Time
	var stored []byte
	insert.Query(func(rows pgx.Rows) error {
		_, err := pgx.ForEachRow(rows, []any{&ord, &st, &id, &started, &stored}, func() error {
			if ord < 1 || ord > int64(n) {
				return fmt.Errorf("answer for job %d of %d", ord, n)
			}
			out[ord-1] = acceptStatus(st)
			got++
			if id != nil && started != nil {
				j := jobs[ord-1].Job
				claimed = append(claimed, Claimed{ID: *id, Queue: j.Queue, JobType: j.JobType, JobKey: j.JobKey,
					JobData: append(json.RawMessage(nil), stored...),
					Attempt: 1, MaxAttempts: j.MaxAttempts, TimeoutSeconds: j.TimeoutSeconds, ExpiresAt: j.ExpiresAt,
					StartedAt: *started}) // (ClaimedLocal: IntakeApply's, before its transaction began)
			}
			return nil
		})
		return err
	})
	if err := tx.SendBatch(ctx, &b).Close(); err != nil {
		return nil, nil, fmt.Errorf("insert jobs: %w", err)
	}
	if got != n {
		return nil, nil, fmt.Errorf("insert jobs: %d answers for %d jobs", got, n)
	}
	return out, claimed, nil
}

// intakeLimit is the intake's claim of one queue with limits: what it read
// under the queue's claim lock, and the batch's jobs that ask to be claimed.
type intakeLimit struct {
	queue  string
	order  correlator.Order
	in     correlator.ClaimInput
	paused bool
	idx    []int // positions in the batch's jobs, in the queue's order
	// values[k] holds the job idx[k]'s share value and rate parts, as the
	// claim's read gives them (PostgreSQL's #>> of job_data).
	values []candidateValues
}

type candidateValues struct {
	share *string
	parts []string
}

// intakeLimited lists the queues of b with limits whose jobs ask to be
// claimed, in the order of their names (the order their claim locks are
// taken in, by every batch).
func intakeLimited(b IntakeBatch) []*intakeLimit {
	if len(b.Limits) == 0 {
		return nil
	}
	by := map[string]*intakeLimit{}
	for i := range b.Jobs {
		j := b.Jobs[i].Job
		lim, ok := b.Limits[j.Queue]
		if !b.Jobs[i].Claim || !ok || !lim.Throttle.Bounded() {
			continue
		}
		l := by[j.Queue]
		if l == nil {
			l = &intakeLimit{queue: j.Queue, order: cmp.Or(lim.Order, correlator.OrderScheduledFirst),
				in: correlator.ClaimInput{Throttle: lim.Throttle}}
			by[j.Queue] = l
		}
		l.idx = append(l.idx, i)
	}
	out := make([]*intakeLimit, 0, len(by))
	for _, l := range by {
		out = append(out, l)
	}
	slices.SortFunc(out, func(a, b *intakeLimit) int { return strings.Compare(a.queue, b.queue) })
	return out
}

// read queues what the plan needs: the claim lock and what counts against
// the limits (queueUsage), and the share values and rate parts of the jobs
// asking to be claimed, read by PostgreSQL as the claim reads them.
func (l *intakeLimit) read(b *pgx.Batch, jobs []IntakeJob) {
	l.in.Usage, l.paused = correlator.ClaimUsage{}, false
	queueUsage(b, false, l.queue, &l.in, &l.paused) // (no claim at intake on Citus)
	t := &l.in.Throttle
	l.values = make([]candidateValues, len(l.idx))
	for k := range l.values {
		l.values[k].parts = make([]string, len(t.Rates))
	}
	args := pgx.NamedArgs{}
	shareCol, parts := valueColumns(t, "d", args)
	if len(args) == 0 {
		return // (no value of job_data counts)
	}
	data := make([]string, len(l.idx))
	for k, i := range l.idx {
		data[k] = string(jobs[i].Job.JobData)
	}
	args["data"] = data
	partsCol := partsArray(parts)
	b.Queue(fmt.Sprintf(`SELECT %s, %s FROM unnest(@data::jsonb[]) WITH ORDINALITY AS u(d, ord) ORDER BY ord`, shareCol, partsCol),
		args).Query(func(rows pgx.Rows) error {
		k := 0
		var v candidateValues
		_, err := pgx.ForEachRow(rows, []any{&v.share, &v.parts}, func() error {
			if k >= len(l.values) {
				return fmt.Errorf("the values of %d jobs for %d", k+1, len(l.values))
			}
			if v.share != nil {
				s := *v.share
				l.values[k].share = &s
			}
			copy(l.values[k].parts, v.parts)
			k++
			return nil
		})
		return err
	})
}

// plan decides which of the queue's jobs asking to be claimed are, as
// correlator.PlanClaim decides a claim of the queue whose candidates they
// are, in the queue's order; the others are stored waiting.
func (l *intakeLimit) plan(jobs []IntakeJob) error {
	for _, i := range l.idx {
		jobs[i].Claim, jobs[i].units = false, nil
	}
	if l.paused {
		return nil
	}
	now := l.in.Now
	key := func(k int) correlator.OrderKey {
		j := jobs[l.idx[k]].Job
		return correlator.OrderKey{Scheduled: cmp.Or(j.ScheduledRunTime, now), Priority: j.Priority}
	}
	order := make([]int, len(l.idx)) // positions in l.idx, in the queue's order
	for k := range order {
		order[k] = k
	}
	slices.SortStableFunc(order, func(a, b int) int { return l.order.Compare(key(a), key(b)) })
	in := l.in
	in.Batch = len(order)
	in.Candidates = make([]correlator.ClaimCandidate, len(order))
	for c, k := range order {
		j := jobs[l.idx[k]].Job
		in.Candidates[c] = correlator.ClaimCandidate{ID: int64(c + 1), State: correlator.StateInitial, JobType: j.JobType,
			Factor: j.ThrottleFactor, Share: l.values[k].share, RateParts: l.values[k].parts, ExpiresAt: j.ExpiresAt}
	}
	plan, err := correlator.PlanClaim(in)
	if err != nil {
		return fmt.Errorf("plan the claim of queue %q at intake: %w", l.queue, err)
	}
	for _, t := range plan.Take {
		jobs[l.idx[order[t.Index]]].Claim = true
	}
	for _, u := range plan.Units {
		for _, pos := range u.Takes {
			i := l.idx[order[plan.Take[pos].Index]]
			jobs[i].units = append(jobs[i].units, u.Window)
		}
	}
	return nil
}

// intakeColumns are a batch of jobs as the insert's arrays, one element
// per job. The trace contexts are nil (unnest pads with NULLs) when no job
// has one, reply_to and correlation when no job asks for its outcome, and
// claim when no job is claimed.
type intakeColumns struct {
	queues, types, keys, data     []string
	maxAtt, prio, factor, timeout []int32
	sched, expires                []*time.Time
	windows                       []*string
	tparents, tstates             []*string
	replyTo, correlation          []*string
	claim                         []bool
	claiming                      bool
	unitRates, unitParts          []string
	unitOrds                      []int64
}

// intakeColumnsOf makes the insert's arrays of jobs; a job asking to be
// claimed (IntakeJob.Claim) is, as far as the job alone decides at now.
func intakeColumnsOf(jobs []IntakeJob, now time.Time) intakeColumns {
	n := len(jobs)
	c := intakeColumns{
		queues: make([]string, n), types: make([]string, n), keys: make([]string, n), data: make([]string, n),
		maxAtt: make([]int32, n), prio: make([]int32, n), factor: make([]int32, n), timeout: make([]int32, n),
		sched: make([]*time.Time, n), expires: make([]*time.Time, n), windows: make([]*string, n),
		tparents: make([]*string, n), tstates: make([]*string, n),
		replyTo: make([]*string, n), correlation: make([]*string, n),
		claim: make([]bool, n),
	}
	traced, asking := false, false
	for i, ij := range jobs {
		j := ij.Job
		c.tparents[i], c.tstates[i] = nullable(j.Trace.Parent), nullable(j.Trace.State)
		traced = traced || j.Trace.Parent != ""
		c.replyTo[i], c.correlation[i] = nullable(j.ReplyTo), correlationJSON(j.Correlation)
		asking = asking || j.ReplyTo != "" || len(j.Correlation) > 0
		c.queues[i], c.types[i], c.keys[i], c.data[i] = j.Queue, j.JobType, j.JobKey, string(j.JobData)
		c.maxAtt[i], c.prio[i], c.factor[i], c.timeout[i] = int32(j.MaxAttempts), int32(j.Priority), int32(j.ThrottleFactor), int32(j.TimeoutSeconds)
		c.sched[i], c.expires[i] = scheduled(j), j.ExpiresAt
		if j.TimeWindows != nil {
			b, _ := json.Marshal(j.TimeWindows)
			w := string(b)
			c.windows[i] = &w
		}
		c.claim[i] = ij.Claim && j.ClaimableAtIntake(now)
		c.claiming = c.claiming || c.claim[i]
		if c.claim[i] {
			for _, w := range ij.units {
				c.unitRates, c.unitParts, c.unitOrds = append(c.unitRates, w.Key), append(c.unitParts, w.Part), append(c.unitOrds, int64(i+1))
			}
		}
	}
	if !traced {
		c.tparents, c.tstates = nil, nil
	}
	if !c.claiming {
		c.claim = nil
	}
	if !asking {
		c.replyTo, c.correlation = nil, nil // (as the trace context's)
	}
	return c
}

// jobsInsertDistributed is jobsInsert on Citus (hipq_job distributed by
// queue), where no job is claimed as it is stored: for each queue of the
// batch, in the order of their names, one insert naming the queue (the
// non-final key is (queue, job_type, job_key) there) and a notice to the
// queue's dispatchers, all in one round trip; then, only for jobs not
// inserted, one lookup per queue of the non-final job in their way. Citus
// runs a statement's modifying CTE and the rest of it on snapshots of
// their own, so unlike jobsInsert's one statement the lookup sees what
// committed after the insert: a job in the way that went final meanwhile
// leaves its job undecided (tried again), and one that another writer put
// in its place is the one compared with.
func jobsInsertDistributed(ctx context.Context, tx pgx.Tx, jobs []IntakeJob) ([]acceptStatus, error) {
	out := make([]acceptStatus, len(jobs))
	byQueue := map[string][]int{}
	for i, ij := range jobs {
		byQueue[ij.Job.Queue] = append(byQueue[ij.Job.Queue], i)
	}
	queues := slices.Sorted(maps.Keys(byQueue))
	var b pgx.Batch
	for _, q := range queues {
		idx := byQueue[q]
		sub := make([]IntakeJob, len(idx))
		for k, i := range idx {
			sub[k] = jobs[i]
			sub[k].Claim = false
		}
		c := intakeColumnsOf(sub, time.Now())
		b.Queue(`/* stores in one queue */
		WITH n AS (
		  SELECT job_type, job_key, job_data, max_attempts, priority, throttle_factor, timeout_seconds,
		         coalesce(scheduled_run_time, now()) AS scheduled_run_time, expires_at, time_windows, trace_parent, trace_state,
		         reply_to, correlation, ord
		  FROM unnest($2::text[], $3::text[], $4::jsonb[], $5::int[], $6::int[], $7::int[], $8::int[],
		              $9::timestamptz[], $10::timestamptz[], $11::jsonb[], $12::text[], $13::text[], $14::text[], $15::jsonb[])
		    WITH ORDINALITY AS n(job_type, job_key, job_data, max_attempts, priority, throttle_factor, timeout_seconds,
		                         scheduled_run_time, expires_at, time_windows, trace_parent, trace_state, reply_to, correlation, ord)
		), ins AS (
		  INSERT INTO hipq_job (queue, job_type, job_key, job_data, max_attempts, priority, throttle_factor,
		                        timeout_seconds, scheduled_run_time, expires_at, time_windows, trace_parent, trace_state,
		                        reply_to, correlation)
		  SELECT $1, job_type, job_key, job_data, max_attempts, priority, throttle_factor, timeout_seconds,
		         scheduled_run_time, expires_at, time_windows, trace_parent, trace_state, reply_to, correlation
		  FROM n
		  ON CONFLICT (queue, job_type, job_key) WHERE state <> 'final' DO NOTHING
		  RETURNING job_type, job_key
		)
		SELECT n.ord FROM n JOIN ins USING (job_type, job_key)`,
			q, c.types, c.keys, c.data, c.maxAtt, c.prio, c.factor, c.timeout, c.sched, c.expires, c.windows,
			c.tparents, c.tstates, c.replyTo, c.correlation).Query(func(rows pgx.Rows) error {
			var ord int64
			_, err := pgx.ForEachRow(rows, []any{&ord}, func() error {
				if ord < 1 || ord > int64(len(idx)) {
					return fmt.Errorf("answer for job %d of %d", ord, len(idx))
				}
				out[idx[ord-1]] = acceptInserted
				return nil
			})
			return err
		})
		// A notice for a queue whose every job was in the way of another
		// wakes its dispatchers for nothing; one round trip less.
		b.Queue("SELECT pg_notify('"+channelJobReady+"', $1)", q)
	}
	if err := tx.SendBatch(ctx, &b).Close(); err != nil {
		return nil, fmt.Errorf("insert jobs: %w", err)
	}
	b = pgx.Batch{}
	for _, q := range queues {
		var idx []int
		for _, i := range byQueue[q] {
			if out[i] != acceptInserted {
				idx = append(idx, i)
			}
		}
		if len(idx) == 0 {
			continue
		}
		types, keys, data := make([]string, len(idx)), make([]string, len(idx)), make([]string, len(idx))
		for k, i := range idx {
			j := jobs[i].Job
			types[k], keys[k], data[k] = j.JobType, j.JobKey, string(j.JobData)
		}
		b.Queue(`/* finds the jobs in the way in one queue */
		SELECT n.ord, j.job_data = n.job_data
		FROM unnest($2::text[], $3::text[], $4::jsonb[]) WITH ORDINALITY AS n(job_type, job_key, job_data, ord)
		JOIN hipq_job j ON j.queue = $1 AND j.job_type = n.job_type AND j.job_key = n.job_key AND j.state <> 'final'`,
			q, types, keys, data).Query(func(rows pgx.Rows) error {
			var ord int64
			var same bool
			_, err := pgx.ForEachRow(rows, []any{&ord, &same}, func() error {
				if ord < 1 || ord > int64(len(idx)) {
					return fmt.Errorf("answer for job %d of %d", ord, len(idx))
				}
				out[idx[ord-1]] = acceptConflict
				if same {
					out[idx[ord-1]] = acceptDuplicate
				}
				return nil
			})
			return err
		})
	}
	if b.Len() > 0 {
		if err := tx.SendBatch(ctx, &b).Close(); err != nil {
			return nil, fmt.Errorf("look up the jobs in the way: %w", err)
		}
	}
	return out, nil
}

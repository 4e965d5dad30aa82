package store

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/hipq/hipq/correlator"
)

// sweeperLockKey is the advisory lock key that lets one instance sweep
// hipq's schema at a time (the hipq of another schema in the same database
// sweeps its own). It only saves work: every sweep step is guarded and
// idempotent.
const sweeperLockKey = `hashtextextended('hipq_sweeper/' || current_schema(), 0)`

// SweeperLock tries to take the sweeper's session lock. When ok, release
// must be called.
func (s *Store) SweeperLock(ctx context.Context) (release func(), ok bool, err error) {
	l, ok, err := s.sessionLock(ctx, sweeperLockKey, "sweeper", "sweeper lock")
	if !ok {
		return nil, false, err
	}
	return l.Release, true, nil
}

// JobTimeOutStuck times out up to limit running jobs whose deadline
// (started_at + timeout_seconds, or the later one news gave the attempt)
// has passed and whose request is known to have left (sent_at, news, or
// an outcome): error "timeout", then the retry policy. A claim not known
// to be sent is the rescue's (AttemptFindUnsent, the same condition),
// never timed out: its attempt would be burned by an outage of hipq's
// own (invariant 8). Rows
// another transaction holds (a reply being applied) are skipped and the
// writes are guarded, so a reply racing a timeout is never overwritten.
func (s *Store) JobTimeOutStuck(ctx context.Context, limit int, types correlator.Types) ([]AttemptRef, error) {
	queues, err := s.queuesOf(ctx, s.runningQueues())
	if err != nil {
		return nil, fmt.Errorf("find timed-out jobs: %w", err)
	}
	var done []AttemptRef
	var errs []error
	for _, q := range queues {
		if len(done) >= limit {
			break
		}
		d, err := s.timeOutQueue(ctx, q, limit-len(done), types)
		done = append(done, d...)
		errs = append(errs, err) // one queue's failure holds none of the others back
	}
	return done, errors.Join(errs...)
}

// queuesOf reads the queues a statement finds (a read over every queue:
// a sweep's writes then name one queue each), in name order.
func (s *Store) queuesOf(ctx context.Context, q string, args ...any) ([]string, error) {
	return queuesIn(ctx, s.pool, q, args...)
}

// queuesIn is queuesOf on db (a transaction, say).
func queuesIn(ctx context.Context, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, q string, args ...any) ([]string, error) {
	rows, err := db.Query(ctx, "SELECT * FROM ("+q+") q ORDER BY 1", args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// runningTimeouts is a WITH RECURSIVE clause that reads, into vals, the
// timeouts (timeout_seconds) of the running jobs of the queue that
// parameter q names, from hipq_job_running_timeout (queue,
// timeout_seconds, started_at) one value at a time, smallest first: a
// skip scan, as cheap beside a million running jobs as beside one. It
// stops at runningTimeoutValues values; the jobs of larger timeouts, if
// any, are read together (the tail), never one probe per value: a queue
// whose jobs carry many different timeouts reads the tail's index
// entries (its rows only where the time condition holds), recent claims
// included.
func runningTimeouts(q string) string {
	return strings.NewReplacer("$Q", q, "$N", strconv.Itoa(runningTimeoutValues)).Replace(`
		WITH RECURSIVE v AS (
		  (SELECT r.timeout_seconds AS secs, 1 AS n FROM hipq_job r WHERE r.queue = $Q AND r.state = 'running'
		   ORDER BY r.timeout_seconds LIMIT 1)
		  UNION ALL
		  SELECT (SELECT r.timeout_seconds FROM hipq_job r
		          WHERE r.queue = $Q AND r.state = 'running' AND r.timeout_seconds > v.secs
		          ORDER BY r.timeout_seconds LIMIT 1), v.n + 1
		  FROM v WHERE v.secs IS NOT NULL AND v.n < $N
		), vals AS (SELECT secs FROM v WHERE secs IS NOT NULL)`)
}

// runningTimeoutValues bounds the timeouts read one by one.
const runningTimeoutValues = 32

// attemptDue is timingOutSQL's condition that the attempt of job r (of
// queue $2) lets the job time out: no news moved its deadline past now,
// and its request is known to have left, or its type is not one of the
// sweeper's ($3). A request of a known type never known to have left (no
// sent_at, no news, no outcome: the very condition of AttemptFindUnsent)
// is the rescue's, which undoes it once its send bound and grace have
// passed, whatever the job's timeout: so an instance that died between
// claim and send, or hipq down longer than the timeout, burns no attempt
// (invariant 8). Of a type the sweeper does not know, neither the send
// bound nor whether it may be sent again is known: the job's own timeout
// ends it, as any other. A probe of the attempt by key (OFFSET 0 keeps it
// a lookup per job, never a scan of every attempt).
const attemptDue = `NOT EXISTS (SELECT 1 FROM hipq_attempt a
		                  WHERE a.queue = $2 AND a.job_id = r.id AND a.attempt = r.attempt
		                    AND (a.deadline >= now()
		                         OR (` + notKnownSent + ` AND r.job_type = ANY ($3)))
		                  OFFSET 0)`

// timingOutSQL finds and locks up to $1 running jobs of queue $2 whose
// time is up. A job's deadline, started_at + timeout_seconds, is no range
// of any index; its time is up when started_at < now() - timeout_seconds,
// a range of hipq_job_running_timeout for each of the queue's timeouts
// (runningTimeouts), oldest first; in the tail, started_at < now() - the
// largest timeout read one by one (smaller than any of the tail's) bounds
// the entries read, and each job's own timeout is checked on its row.
// Left out (attemptDue) are a job whose attempt got news that moved its
// deadline past now, and one whose request is not known to have left. The
// versions found are collected first (an array the statement computes
// once) and locked by tuple id: a condition on the state would let the
// planner read the queue's running jobs by that index again instead. A
// version that changed since it was found is no longer the one named:
// PostgreSQL checks the tuple id again on the version it locks (releases
// from late 2025: the fix of the TID scan's recheck, back to 13). On an
// older release the newer version is locked and returned: the time
// condition leaves out a job claimed again since (its started_at is new),
// and the resolve, guarded by the state and attempt the job was found in,
// leaves any other alone.
var timingOutSQL = `
		SELECT j.id, j.job_type, j.attempt, j.max_attempts, j.expires_at, j.time_windows, now() FROM hipq_job j
		WHERE j.ctid = ANY (ARRAY(` + runningTimeouts("$2") + `
		        SELECT x.tid FROM vals CROSS JOIN LATERAL (
		          SELECT r.ctid AS tid FROM hipq_job r
		          WHERE r.queue = $2 AND r.state = 'running' AND r.timeout_seconds = vals.secs
		            AND r.started_at < now() - make_interval(secs => vals.secs)
		            AND ` + attemptDue + `
		          ORDER BY r.started_at LIMIT $1) x
		        UNION ALL
		        (SELECT r.ctid FROM hipq_job r
		         WHERE r.queue = $2 AND r.state = 'running' AND r.timeout_seconds > (SELECT max(secs) FROM vals)
		           AND r.started_at < now() - make_interval(secs => (SELECT max(secs) FROM vals))
		           AND r.started_at + make_interval(secs => r.timeout_seconds) < now()
		           AND ` + attemptDue + `
		         LIMIT $1)))
		  AND j.queue = $2 AND j.started_at + make_interval(secs => j.timeout_seconds) < now()
		ORDER BY j.id LIMIT $1
		FOR UPDATE OF j SKIP LOCKED`

// timeOutQueue is JobTimeOutStuck in one queue. Its statements reach rows
// by index only (sequential scans off for its transaction: on statistics
// that say the tables are small, a probe of each job's attempt could be a
// scan of every attempt).
func (s *Store) timeOutQueue(ctx context.Context, queue string, limit int, types correlator.Types) ([]AttemptRef, error) {
	var done []AttemptRef
	err := s.inTx(ctx, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
			return fmt.Errorf("find timed-out jobs: %w", err)
		}
		rows, err := tx.Query(ctx, timingOutSQL, limit, queue, types.Names())
		if err != nil {
			return fmt.Errorf("find timed-out jobs: %w", err)
		}
		var rs []Resolve
		var id int64
		var jt string
		var run correlator.Running
		var windows []byte
		var now time.Time // PostgreSQL's: retries are scheduled on the clock the claim reads
		_, err = pgx.ForEachRow(rows, []any{&id, &jt, &run.Attempt, &run.MaxAttempts, &run.ExpiresAt, &windows, &now}, func() error {
			r := run
			// Windows this build cannot read are left out of the retry's
			// schedule (the claim still applies them): never a reason to
			// leave the job running for ever.
			r.Windows, _ = decodeWindows(windows)
			rs = append(rs, Resolve{Queue: queue, JobID: id, Attempt: r.Attempt, Res: correlator.TimedOut(types.Get(jt), r, now)})
			return nil
		})
		if err != nil {
			return fmt.Errorf("find timed-out jobs: %w", err)
		}
		if rs, err = withoutNews(ctx, tx, queue, rs); err != nil {
			return err
		}
		r, err := jobResolveMany(ctx, tx, s.events, rs)
		done = refsOf(r)
		return err
	})
	return done, err
}

// withoutNews drops the candidates whose attempt got news that moved its
// deadline past now, committed after the finding statement's snapshot but
// before its row lock (news locks the job's row, not its attempt's, so
// PostgreSQL's re-check of a locked row would not see it). The job rows
// are locked now, so this statement's fresh snapshot is the last word: a
// heartbeat racing a timeout, exactly one wins.
func withoutNews(ctx context.Context, tx pgx.Tx, queue string, rs []Resolve) ([]Resolve, error) {
	if len(rs) == 0 {
		return rs, nil
	}
	ids, atts := make([]int64, len(rs)), make([]int32, len(rs))
	for i, r := range rs {
		ids[i], atts[i] = r.JobID, int32(r.Attempt)
	}
	rows, err := tx.Query(ctx, `
		SELECT a.job_id FROM hipq_attempt a JOIN unnest($1::bigint[], $2::int[]) AS k(id, att)
		  ON a.job_id = k.id AND a.attempt = k.att
		WHERE a.queue = $3 AND a.deadline >= now()`, ids, atts, queue)
	if err != nil {
		return nil, fmt.Errorf("re-check deadlines: %w", err)
	}
	moved := map[int64]bool{}
	var id int64
	if _, err := pgx.ForEachRow(rows, []any{&id}, func() error { moved[id] = true; return nil }); err != nil {
		return nil, fmt.Errorf("re-check deadlines: %w", err)
	}
	out := rs[:0]
	for _, r := range rs {
		if !moved[r.JobID] {
			out = append(out, r)
		}
	}
	return out, nil
}

// Unsent is a claim whose request was never acknowledged as sent.
type Unsent struct {
	AttemptRef
	JobType      string
	DispatchedAt time.Time
}

// findUnsentSQL finds the unsent claims of queue @queue, of the types
// @job_type (with their send bounds @send_bound), through its running jobs
// claimed since @since and longer ago than the least send bound
// (@least_bound) plus @grace: for each of the queue's timeouts (runningTimeouts), a range of
// hipq_job_running_timeout (queue, timeout_seconds, started_at; a running
// job's started_at is its attempt's dispatched_at), so a burst of recent
// claims is not read, nor the old ones a sweep before examined (but for
// the tail's index entries, when the queue's jobs carry more than
// runningTimeoutValues timeouts). Each one's current attempt is looked up
// by its key (OFFSET 0: never flattened into a scan of hipq_attempt for
// unsent rows, which statistics may say do not exist). It returns up to @limit
// claims past their own type's bound (due, oldest first), then one row
// (id NULL) with the earliest start of the unsent claims not yet past
// theirs, and the range's end.
var findUnsentSQL = runningTimeouts("@queue") + `, cand AS (
		SELECT j.queue, j.id, j.attempt, j.job_type, a.dispatched_at, j.started_at,
		       a.dispatched_at < now() - make_interval(secs => t.secs) - @grace::interval AS due
		FROM (SELECT x.* FROM vals
		      CROSS JOIN LATERAL (SELECT r.queue, r.id, r.attempt, r.job_type, r.started_at FROM hipq_job r
		                          WHERE r.queue = @queue AND r.state = 'running' AND r.timeout_seconds = vals.secs
		                            AND r.started_at >= @since::timestamptz AND r.started_at < now() - make_interval(secs => @least_bound::float8) - @grace::interval
		                          OFFSET 0) x
		      UNION ALL
		      SELECT r.queue, r.id, r.attempt, r.job_type, r.started_at FROM hipq_job r
		      WHERE r.queue = @queue AND r.state = 'running' AND r.timeout_seconds > (SELECT max(secs) FROM vals)
		        AND r.started_at >= @since::timestamptz AND r.started_at < now() - make_interval(secs => @least_bound::float8) - @grace::interval) j
		CROSS JOIN LATERAL (SELECT b.dispatched_at, b.sent_at, b.outcome, b.progress_at FROM hipq_attempt b
		                    WHERE b.queue = j.queue AND b.job_id = j.id AND b.attempt = j.attempt OFFSET 0) a
		JOIN unnest(@job_type::text[], @send_bound::float8[]) AS t(job_type, secs) ON t.job_type = j.job_type
		WHERE ` + notKnownSent + `
		)
		(SELECT queue, id, attempt, job_type, dispatched_at, started_at FROM cand WHERE due ORDER BY started_at LIMIT @limit)
		UNION ALL
		SELECT NULL, NULL, NULL, NULL, now() - make_interval(secs => @least_bound::float8) - @grace::interval, min(started_at) FROM cand WHERE NOT due`

// findUnsentCitusSQL is findUnsentSQL on Citus, one statement Citus sends
// whole to the queue's shard (findUnsentSQL's parts it would plan apart):
// every candidate, with whether it is due, once; the sweep makes of them
// what findUnsentSQL's two parts give (unsentOnCitus). The worker reads
// the queue's running jobs claimed in the range, as its planner chooses.
var findUnsentCitusSQL = `
		SELECT j.queue, j.id, j.attempt, j.job_type, a.dispatched_at, j.started_at,
		       a.dispatched_at < now() - make_interval(secs => t.secs) - @grace::interval AS due
		FROM hipq_job j
		JOIN hipq_attempt a ON a.queue = j.queue AND a.job_id = j.id AND a.attempt = j.attempt
		JOIN unnest(@job_type::text[], @send_bound::float8[]) AS t(job_type, secs) ON t.job_type = j.job_type
		WHERE j.queue = @queue AND a.queue = @queue AND j.state = 'running' AND j.started_at >= @since::timestamptz
		  AND j.started_at < now() - make_interval(secs => @least_bound::float8) - @grace::interval
		  AND ` + notKnownSent

// unsentOnCitus runs findUnsentCitusSQL and makes of its rows what
// findUnsentSQL's two parts give: up to @limit due claims, oldest first,
// and the start of the earliest claim not yet due.
func unsentOnCitus(ctx context.Context, tx pgx.Tx, args pgx.StrictNamedArgs) (due []Unsent, earliest *time.Time, err error) {
	rows, err := tx.Query(ctx, findUnsentCitusSQL, pgx.NamedArgs(args)) // (@limit is applied here)
	if err != nil {
		return nil, nil, err
	}
	var u Unsent
	var isDue bool
	_, err = pgx.ForEachRow(rows, []any{&u.Queue, &u.JobID, &u.Attempt, &u.JobType, &u.DispatchedAt, &u.Claim, &isDue}, func() error {
		if isDue {
			due = append(due, u)
		} else if earliest == nil || u.Claim.Before(*earliest) {
			t := u.Claim
			earliest = &t
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	slices.SortFunc(due, func(a, b Unsent) int { return a.Claim.Compare(b.Claim) })
	return due[:min(len(due), args["limit"].(int))], earliest, nil
}

// runningQueuesSQL lists the queues with running jobs, read from their
// index one queue at a time (a skip scan: as cheap with a million running
// jobs as with one).
const runningQueuesSQL = `
		WITH RECURSIVE q AS (
		  (SELECT queue FROM hipq_job WHERE state = 'running' ORDER BY queue LIMIT 1)
		  UNION ALL
		  SELECT (SELECT j.queue FROM hipq_job j WHERE j.state = 'running' AND j.queue > q.queue ORDER BY j.queue LIMIT 1)
		  FROM q WHERE q.queue IS NOT NULL
		)
		SELECT queue FROM q WHERE queue IS NOT NULL`

// runningQueuesCitusSQL is runningQueuesSQL on Citus, which plans a
// recursive CTE only within one shard: each shard lists its own queues
// from its running jobs (a read of the running jobs' index entries).
const runningQueuesCitusSQL = `SELECT DISTINCT queue FROM hipq_job WHERE state = 'running'`

// runningQueues is the statement that lists the queues with running jobs.
func (s *Store) runningQueues() string {
	if s.dist {
		return runningQueuesCitusSQL
	}
	return runningQueuesSQL
}

// UnsentMarks say, per queue, how far searches for unsent claims have
// looked: every claim of the queue that started before its mark was found
// sent (or with news, or ended), or was handed to the rescue as unsent. A
// claim found sent stays so, and a new claim starts at the claim's now(),
// past every mark; so a search that starts from the marks reads only the
// claims that became old enough since, not every running job again (a
// million running jobs awaiting late replies: seconds a sweep).
type UnsentMarks map[string]time.Time

// LateClaimMargin is how far before its mark a queue's search starts
// again. A claim's started_at is its transaction's start, so a claim not
// yet committed when a search reads could start before the mark that
// search sets: each mark is held at or before the start of every other
// transaction open in the database then (pg_stat_activity, read before
// the search), which covers them. The margin covers what that view may
// not show (transactions of roles whose activity hipq's role cannot
// see), and the sweeper searches from no marks now and then.
const LateClaimMargin = time.Minute

// AttemptFindUnsent lists running jobs whose current attempt has no
// sent_at (nor news: progress proves the request left) though it was
// claimed longer ago than its type's send bound
// (JobType.SendBound; a type not configured here gets the default) plus
// grace, oldest first. The deadline is PostgreSQL's, on the clock that
// stamped dispatched_at: no other clock enters it. It reads indexes only
// (sequential scans off for its transaction: a plan made on statistics
// that say the table is small would read every row, final ones included,
// at every sweep), each queue's running jobs older than the least bound
// that started after from's mark for the queue (less LateClaimMargin; no
// mark: all of them).
//
// It also returns the marks that hold once the claims it lists are
// handed to the rescue: for each queue, the end of the range read, or the
// start of the earliest unsent claim not yet past its own bound, or of the
// oldest transaction open, whichever is earliest. When it lists limit
// claims, some may be left unlisted: it returns from.
func (s *Store) AttemptFindUnsent(ctx context.Context, types correlator.Types, grace time.Duration, limit int,
	from UnsentMarks) ([]Unsent, UnsentMarks, error) {
	if len(types) == 0 {
		return nil, from, nil
	}
	var names []string
	var secs []float64
	least := math.Inf(1)
	for name, jt := range types {
		b := jt.SendBound().Seconds()
		names, secs = append(names, name), append(secs, b)
		least = min(least, b)
	}
	var out []Unsent
	marks := UnsentMarks{}
	err := pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
			return err
		}
		// The oldest transaction open now, before the search reads: a
		// claim the search cannot see yet is one of them, or started
		// after, so no mark may pass its start. (PostgreSQL reads the
		// activity once per transaction, at its first look.)
		// (And the transaction's now(), the same in each of its statements.)
		// On Citus, the whole cluster's: a claim through another node is
		// a transaction there, which this node's view does not show.
		activity := "pg_stat_activity"
		if s.dist {
			activity = "citus_stat_activity"
		}
		var oldest *time.Time
		var now time.Time
		if err := tx.QueryRow(ctx, `SELECT (SELECT min(xact_start) FROM `+activity+`
			WHERE datname = current_database() AND pid <> pg_backend_pid()), now()`).Scan(&oldest, &now); err != nil {
			return err
		}
		// mark sets queue q's mark: the range's end, or the earliest claim
		// not yet due, or the oldest transaction, whichever is earliest.
		mark := func(q string, end time.Time, earliest *time.Time) {
			marks[q] = end
			for _, t := range []*time.Time{earliest, oldest} {
				if t != nil && t.Before(marks[q]) {
					marks[q] = *t
				}
			}
		}
		queues, err := queuesIn(ctx, tx, s.runningQueues())
		if err != nil {
			return err
		}
		for _, q := range queues {
			since := pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
			if m, ok := from[q]; ok {
				since = pgtype.Timestamptz{Time: m.Add(-LateClaimMargin), Valid: true}
			}
			args := pgx.StrictNamedArgs{"job_type": names, "send_bound": secs, "grace": grace,
				"limit": limit, "queue": q, "least_bound": least, "since": since}
			if s.dist {
				due, earliest, err := unsentOnCitus(ctx, tx, args)
				if err != nil {
					return err
				}
				out = append(out, due...)
				mark(q, now.Add(-time.Duration(least*float64(time.Second))-grace), earliest)
				continue
			}
			rows, err := tx.Query(ctx, findUnsentSQL, args)
			if err != nil {
				return err
			}
			var (
				u       Unsent
				id      *int64
				queue   *string
				att     *int
				jobType *string
				claim   *time.Time
			)
			// The claim is the job's started_at (the column the undo and
			// the resolve compare; the claim wrote the same time in
			// dispatched_at): the rescue moves the claim it read, never a
			// later one.
			if _, err := pgx.ForEachRow(rows, []any{&queue, &id, &att, &jobType, &u.DispatchedAt, &claim}, func() error {
				if id == nil { // the last row: the range's end, the earliest claim not yet due
					mark(q, u.DispatchedAt, claim)
					return nil
				}
				u.Queue, u.JobID, u.Attempt, u.JobType, u.Claim = *queue, *id, *att, *jobType, *claim
				out = append(out, u)
				return nil
			}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, from, fmt.Errorf("find unsent claims: %w", err)
	}
	slices.SortFunc(out, func(a, b Unsent) int { return a.DispatchedAt.Compare(b.DispatchedAt) })
	if len(out) >= limit {
		return out[:limit], from, nil
	}
	return out, marks, nil
}

// JobExpire ends up to limit waiting jobs past expires_at: final / expired.
func (s *Store) JobExpire(ctx context.Context, limit int) (int, error) {
	queues, err := s.queuesOf(ctx, `SELECT DISTINCT queue FROM hipq_job
		WHERE state IN ('initial', 'retry') AND expires_at <= now()`)
	if err != nil {
		return 0, fmt.Errorf("expire jobs: %w", err)
	}
	total := 0
	var errs []error
	for _, q := range queues {
		if total >= limit {
			break
		}
		var n int
		args := []any{limit - total, q}
		if s.events.On() {
			types, topics, attempts := s.events.args()
			args = append(args, types, topics, attempts)
		}
		err := s.pool.QueryRow(ctx, expireForms.pick(s.events.On(), s.dist), args...).Scan(&n)
		if err == nil && n > 0 && s.dist {
			err = notifyCitus(ctx, s.pool, s.events.On(), q)
		}
		total += n
		if err != nil {
			errs = append(errs, fmt.Errorf("expire jobs of queue %q: %w", q, err))
		}
	}
	return total, errors.Join(errs...)
}

// expireSQL ends up to $1 waiting jobs of queue $2 past expires_at.
var expireSQL = `
		WITH done AS (
		  UPDATE hipq_job j
		  SET state = 'final', outcome = 'expired', error = 'expired', update_time = now()
		  FROM (SELECT id, state, attempt FROM hipq_job
		        WHERE queue = $2 AND state IN ('initial', 'retry') AND expires_at <= now()
		        ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED) d
		  WHERE j.queue = $2 AND j.id = d.id AND j.state = d.state AND j.attempt = d.attempt
		  RETURNING j.id, j.queue, j.job_type, j.attempt/*event columns*/
		), /*events*/notify AS ( -- waits for these jobs look now
		  SELECT pg_notify('` + channelJobReady + `', $2) WHERE EXISTS (SELECT 1 FROM done)
		)
		SELECT count(*) FROM done WHERE (SELECT count(*) FROM notify) >= 0`

// expireEventsSQL is expireSQL that writes the jobs' outcome events too,
// with the routes in $3, $4 and $5.
var expireEventsSQL = withEvents(expireSQL, "$3", "$4", "$5")

// expireForms are expireSQL's texts. On Citus the notice goes in a
// statement of its own (notifyCitus), after it.
var expireForms = formsOf(expireSQL, expireEventsSQL, expireForCitus)

func expireForCitus(stmt string) string {
	return mustReplace(stmt, "SELECT pg_notify('"+channelJobReady+"', $2) WHERE EXISTS (SELECT 1 FROM done)", "SELECT 1")
}

// JobPrune deletes up to limit final jobs (and their attempts) last updated
// longer than retention ago, on PostgreSQL's clock.
func (s *Store) JobPrune(ctx context.Context, retention time.Duration, limit int) (int, error) {
	// The oldest rows due, in every queue (a read), then each queue's
	// share deleted: the rows are locked or skipped (SKIP LOCKED) by a
	// statement naming the queue, and deleted by tuple id.
	read := `SELECT queue, id FROM hipq_job j
		WHERE state = 'final' AND update_time < now() - $1::interval ORDER BY update_time LIMIT $2`
	if !s.dist {
		// A job whose final event is read from it stays until the relay
		// passed it (its topic's cursor), however old: its event is
		// pending. (A final job is never updated, and a cursor never moves
		// back: the delete need not look again.)
		read = strings.Replace(read, "ORDER BY", `AND (event_id IS NULL OR NOT (`+eventOnJobPending+`)) ORDER BY`, 1)
	}
	rows, err := s.pool.Query(ctx, read, retention, limit)
	if err != nil {
		return 0, fmt.Errorf("prune final jobs: %w", err)
	}
	due := map[string][]int64{}
	var q string
	var id int64
	if _, err := pgx.ForEachRow(rows, []any{&q, &id}, func() error { due[q] = append(due[q], id); return nil }); err != nil {
		return 0, fmt.Errorf("prune final jobs: %w", err)
	}
	total := 0
	var errs []error
	for _, q := range slices.Sorted(maps.Keys(due)) {
		var n int
		err := s.pool.QueryRow(ctx, pruneSQL, retention, due[q], q).Scan(&n)
		total += n
		if err != nil {
			errs = append(errs, fmt.Errorf("prune final jobs of queue %q: %w", q, err))
		}
	}
	return total, errors.Join(errs...)
}

// pruneSQL deletes the final jobs of ids $2 in queue $3 (and their
// attempts) last updated longer than $1 ago: each found by its id, locked
// unless another transaction holds it, deleted by its tuple id.
const pruneSQL = `
		WITH gone AS (
		  DELETE FROM hipq_job j
		  USING (SELECT ctid FROM hipq_job WHERE queue = $3 AND id = ANY($2) AND state = 'final' AND update_time < now() - $1::interval
		         FOR UPDATE SKIP LOCKED) d
		  WHERE j.queue = $3 AND j.ctid = d.ctid
		  RETURNING j.id
		), attempts AS (
		  DELETE FROM hipq_attempt a USING gone WHERE a.queue = $3 AND a.job_id = gone.id
		)
		SELECT count(*) FROM gone`

// DeadLetterPrune deletes up to limit dead letters received longer than
// retention ago, on PostgreSQL's clock.
func (s *Store) DeadLetterPrune(ctx context.Context, retention time.Duration, limit int) (int, error) {
	tag, err := s.pool.Exec(ctx, `
		DELETE FROM hipq_dead_letter WHERE id IN (
		  SELECT id FROM hipq_dead_letter WHERE received_at < now() - $1::interval ORDER BY id LIMIT $2)`, retention, limit)
	if err != nil {
		return 0, fmt.Errorf("prune dead letters: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

// OperationPrune deletes up to limit bulk operations that ended (done or
// stopped) longer than retention ago, on PostgreSQL's clock: they are
// kept as long as the final jobs they acted on.
func (s *Store) OperationPrune(ctx context.Context, retention time.Duration, limit int) (int, error) {
	tag, err := s.pool.Exec(ctx, `
		DELETE FROM hipq_operation WHERE id IN (
		  SELECT id FROM hipq_operation WHERE state <> 'running' AND updated_at < now() - $1::interval ORDER BY id LIMIT $2)`,
		retention, limit)
	if err != nil {
		return 0, fmt.Errorf("prune operations: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

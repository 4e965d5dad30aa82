package store

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
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
	// WindowsErr says why the job's own time windows could not be read:
	// the claim took them as open all day, and so does its retry
	// scheduling.
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
	// Deferral is what the claim decided for it (correlator.PlanClaim):
	// its next opening, or its end when that is past its expiry.
	Deferral Deferral
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
	// Held says a claim of a queue with limits left due jobs of its types
	// waiting (for room under the limits, or for the next batch): new jobs
	// of the queue come after them.
	Held bool
	// WindowsErr says why the open jobs with time windows a claim of a
	// queue without limits found were not moved (its plan or second
	// statement failed; the jobs without windows it moved are in Jobs):
	// they wait for a later claim.
	WindowsErr error
}

// Now estimates PostgreSQL's clock now (see Claimed.DBNow).
func (c *Claim) Now() time.Time { return c.DBNow.Add(time.Since(c.Local)) }

// dueProbeSQL is JobsDue's probe: $1 the queue, $2 the types.
const dueProbeSQL = `/* due probe */ SELECT NOT EXISTS (SELECT 1 FROM hipq_queue p WHERE p.name = $1 AND p.paused)
	AND EXISTS (SELECT 1 FROM unnest($2::text[]) AS t(job_type)
	            WHERE (SELECT j.id FROM hipq_job j WHERE j.queue = $1 AND j.job_type = t.job_type AND ` + dueSQL + `
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
		args := []any{ids, states, atts, runAt, expire, correlator.ErrorExpired, q}
		if s.events.On() && slices.Contains(expire, true) {
			types, topics, attempts := s.events.args()
			var n int
			err := s.pool.QueryRow(ctx, deferEventsSQL, append(args, types, topics, attempts)...).Scan(&n)
			moved += n
			return err
		}
		tag, err := s.pool.Exec(ctx, deferSQL, args...)
		moved += int(tag.RowsAffected())
		return err
	})
	if err != nil {
		return moved, fmt.Errorf("reschedule jobs outside their time windows: %w", err)
	}
	return moved, nil
}

// deferSQL moves the waiting jobs of queue $7 of ids $1 (expected states
// $2, attempts $3) to run at $4, or, where $5, ends them final / expired
// (error $6).
const deferSQL = `
		UPDATE hipq_job j
		SET scheduled_run_time = CASE WHEN u.expire THEN j.scheduled_run_time ELSE u.run_at END,
		    state = CASE WHEN u.expire THEN 'final' ELSE j.state END,
		    outcome = CASE WHEN u.expire THEN 'expired' ELSE j.outcome END,
		    error = CASE WHEN u.expire THEN $6 ELSE j.error END,
		    update_time = now()
		FROM unnest($1::bigint[], $2::text[], $3::int[], $4::timestamptz[], $5::bool[]) AS u(id, state, att, run_at, expire)
		WHERE j.queue = $7 AND j.id = u.id AND j.state = u.state AND j.attempt = u.att AND j.state IN ('initial', 'retry')`

// deferEventsSQL is deferSQL that writes the outcome events of the jobs it
// ends (routes in $8, $9 and $10), and returns how many rows it moved.
var deferEventsSQL = withEvents(`
		WITH moved AS (`+deferSQL+`
		  RETURNING j.id, j.queue, j.job_type, j.attempt/*event columns*/
		), done AS (
		  SELECT * FROM moved WHERE state = 'final'
		), /*events*/counted AS (SELECT count(*) AS n FROM moved)
		SELECT n FROM counted`, "$8", "$9", "$10")

// dueSQL is the one definition, in SQL, of a due job j: waiting (initial
// or retry) and dueTimeSQL (correlator.Job.Due in Go).
const dueSQL = `j.state IN ('initial', 'retry') AND ` + dueTimeSQL

// dueTimeSQL says, on PostgreSQL's clock, that the time of a job j has
// come and it has not expired.
const dueTimeSQL = `j.scheduled_run_time <= now() AND (j.expires_at IS NULL OR j.expires_at > now())`

// claimSettings are the claim's planner settings: every statement reaches
// its rows through an index or by id, whatever the statistics say (taken
// while a burst waited, they would have the planner read the table; taken
// while a type was rare, read every non-final job of it through the key
// index, sorted). A statement that cannot avoid a sort still runs one. JIT
// compiled the statements at every call.
const claimSettings = `SELECT set_config('enable_sort', 'off', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)`

// claimColumns are what a claim returns of each job it moved.
const claimColumns = `j.id, j.job_type, j.job_key, j.job_data, j.state, j.attempt, j.max_attempts, j.timeout_seconds, j.expires_at,
	j.time_windows, j.started_at`

// JobClaim moves up to Limit due jobs of one queue to running: attempt+1,
// started_at, and a hipq_attempt row each, in the queue's order and within
// its limits, as correlator.PlanClaim decides. Jobs past their expiry are
// never claimed; a job is moved only from the state and attempt it was read
// in, so dispatchers on many instances never claim the same job. A paused
// queue claims nothing. Due jobs found outside their time windows are
// returned in Closed, for the caller to move to their next opening.
//
// A queue without limits is claimed in one round trip: its first due jobs
// in the queue's order are locked (SKIP LOCKED keeps concurrent dispatchers
// off each other's rows) and moved in one statement; those with time
// windows (their own, or their type's) are returned locked but not moved,
// for the domain to judge, and the open ones are moved by a second
// statement. A queue with limits (correlator.Throttle.Bounded) is claimed
// under an advisory transaction lock of the queue, so dispatchers on many
// instances claim one after the other and each counts what the others
// claimed: one round trip settles the rate units and reads what counts
// against the limits, one reads the due jobs the limits leave room for
// (correlator.NarrowClaim), PlanClaim decides, and one writes the plan and
// commits.
func (s *Store) JobClaim(ctx context.Context, p JobClaimParams) (Claim, error) {
	p.Order = cmp.Or(p.Order, correlator.OrderScheduledFirst)
	local := time.Now()
	if p.Types == nil {
		types, err := s.waitingTypes(ctx, p.Queue)
		if err != nil {
			return Claim{}, fmt.Errorf("claim due jobs of queue %q: %w", p.Queue, err)
		}
		p.Types = types
	}
	if len(p.Types) == 0 || p.Limit < 1 {
		return Claim{Local: local}, nil
	}
	if len(p.TypeWindows) > 0 {
		tw := make(map[string][]correlator.TimeWindow, len(p.TypeWindows))
		for name, ws := range p.TypeWindows {
			ws = slices.Clone(ws)
			if err := correlator.CompileWindows(ws); err != nil {
				return Claim{}, fmt.Errorf("claim due jobs of queue %q: the time windows of type %q: %w", p.Queue, name, err)
			}
			tw[name] = ws
		}
		p.TypeWindows = tw
	}
	var out Claim
	var err error
	if p.Throttle.Bounded() {
		out, err = s.claimBounded(ctx, p)
	} else {
		out, err = s.claimUnbounded(ctx, p)
	}
	if err != nil {
		// Should the connection fail while the rows came, whether the claim
		// committed is unknown, so nothing is sent (a claim that did commit
		// is the sweeper's to rescue).
		return Claim{}, fmt.Errorf("claim due jobs of queue %q: %w", p.Queue, err)
	}
	out.Local = local
	for i := range out.Jobs {
		out.Jobs[i].ClaimedLocal = local
	}
	return out, nil
}

// waitingTypes are the types with a waiting job in queue: a skip scan of
// the due index, one probe per type.
func (s *Store) waitingTypes(ctx context.Context, queue string) ([]string, error) {
	rows, err := s.pool.Query(ctx, `
		WITH RECURSIVE t(job_type) AS (
		    (SELECT j.job_type FROM hipq_job j WHERE j.queue = $1 AND j.state IN ('initial', 'retry') ORDER BY j.job_type LIMIT 1)
		    UNION ALL
		    SELECT (SELECT j.job_type FROM hipq_job j WHERE j.queue = $1 AND j.state IN ('initial', 'retry')
		              AND j.job_type > t.job_type ORDER BY j.job_type LIMIT 1)
		    FROM t WHERE t.job_type IS NOT NULL
		)
		SELECT t.job_type FROM t WHERE t.job_type IS NOT NULL`, queue)
	if err != nil {
		return nil, err
	}
	types, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if types == nil {
		types = []string{}
	}
	return types, err
}

// windowedTypes are the types of p with time windows of their own.
func (p *JobClaimParams) windowedTypes() []string {
	out := []string{}
	for _, t := range p.Types {
		if len(p.TypeWindows[t]) > 0 {
			out = append(out, t)
		}
	}
	return out
}

// orderSQL is the queue's order on the columns of alias.
func orderSQL(o correlator.Order, alias string) string {
	cols := strings.Split(o.Columns(), ", ")
	for i, c := range cols {
		cols[i] = alias + "." + c
	}
	return strings.Join(cols, ", ")
}

// claimedRow scans a row of claimColumns.
type claimedRow struct {
	c       Claimed
	state   string
	data    []byte // (bytes: pgx copies them, where a json.RawMessage is decoded and encoded again)
	windows []byte
}

func (r *claimedRow) dest() []any {
	return []any{&r.c.ID, &r.c.JobType, &r.c.JobKey, &r.data, &r.state, &r.c.Attempt, &r.c.MaxAttempts,
		&r.c.TimeoutSeconds, &r.c.ExpiresAt, &r.windows, &r.c.StartedAt}
}

// claimed is the job the row holds, of queue. Unreadable windows are
// taken as open, as the claim takes them, and said in WindowsErr.
func (r *claimedRow) claimed(queue string) Claimed {
	c := r.c
	c.Queue = queue
	c.JobData = append(json.RawMessage(nil), r.data...)
	ws, err := decodeWindows(r.windows)
	if err != nil {
		err = fmt.Errorf("job %d: time_windows: %w", c.ID, err)
	}
	c.TimeWindows, c.WindowsErr = ws, err
	return c
}

// candidate is a due job read by a claim, as PlanClaim sees it, with what
// the claim returns of it should it be deferred.
type candidate struct {
	correlator.ClaimCandidate
	scheduled  time.Time
	priority   int
	windowsErr error
}

// candidateOf makes a candidate of what a claim read; windows it cannot
// read are open (an empty list, not its type's).
func candidateOf(c correlator.ClaimCandidate, windows []byte) candidate {
	ws, err := decodeWindows(windows)
	if err != nil {
		err = fmt.Errorf("job %d: time_windows: %w", c.ID, err)
		ws = []correlator.TimeWindow{}
	} else if windows != nil && ws == nil {
		ws = []correlator.TimeWindow{}
	}
	c.TimeWindows = ws
	return candidate{ClaimCandidate: c, windowsErr: err}
}

// closedOf is the deferral d of cs's candidate as Claim returns it.
func closedOf(queue string, cs []candidate, d correlator.ClaimDeferral) Closed {
	c := &cs[d.Index]
	cl := Closed{Queue: queue, ID: c.ID, JobType: c.JobType, State: c.State, Attempt: c.Attempt, ExpiresAt: c.ExpiresAt,
		WindowsErr: c.windowsErr,
		Deferral:   Deferral{Queue: queue, ID: c.ID, State: c.State, Attempt: c.Attempt, RunAt: d.RunAt, Expire: d.Expire}}
	if c.windowsErr == nil {
		cl.TimeWindows = c.TimeWindows
	}
	return cl
}

// claimUnbounded claims a queue without limits (see JobClaim).
func (s *Store) claimUnbounded(ctx context.Context, p JobClaimParams) (Claim, error) {
	var out Claim
	var windowed []candidate
	keys := map[int64]correlator.OrderKey{}
	args := pgx.NamedArgs{"queue": p.Queue, "limit": p.Limit, "instance": p.Instance, "windowed": p.windowedTypes()}
	for i, t := range p.Types {
		args[fmt.Sprintf("type_%d", i)] = t
	}
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(claimSettings)
	b.Queue(unboundedSQL(p.Order, len(p.Types), s.dist), args).Query(func(rs pgx.Rows) error {
		var r claimedRow
		var moved bool
		var sched time.Time
		var prio int
		dest := append(append([]any{&moved}, r.dest()...), &out.DBNow, &sched, &prio)
		_, err := pgx.ForEachRow(rs, dest, func() error {
			keys[r.c.ID] = correlator.OrderKey{Scheduled: sched, Priority: prio, ID: r.c.ID}
			if moved {
				out.Jobs = append(out.Jobs, r.claimed(p.Queue))
				return nil
			}
			w := candidateOf(correlator.ClaimCandidate{ID: r.c.ID, State: correlator.State(r.state),
				Attempt: r.c.Attempt, JobType: r.c.JobType, ExpiresAt: r.c.ExpiresAt}, r.windows)
			w.scheduled, w.priority = sched, prio
			windowed = append(windowed, w)
			return nil
		})
		return err
	})
	b.Queue("COMMIT")
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return Claim{}, err
	}
	if len(windowed) == 0 {
		return out, nil
	}
	// Jobs with time windows: the domain judges them; the open ones are
	// moved as the claim moves any, guarded by the state and attempt they
	// were read in.
	in := correlator.ClaimInput{Batch: len(windowed), Now: out.DBNow, TypeWindows: p.TypeWindows}
	for _, w := range windowed {
		in.Candidates = append(in.Candidates, w.ClaimCandidate)
	}
	// The first statement committed: whatever happens to the second, its
	// jobs are returned, to be sent. A second that fails leaves the open
	// jobs waiting, for a later claim (or, should its commit be in doubt,
	// running unsent, for the sweeper's rescue).
	plan, err := correlator.PlanClaim(in)
	if err != nil {
		out.WindowsErr = fmt.Errorf("plan the jobs with time windows: %w", err)
	} else {
		for _, d := range plan.Defer {
			out.Closed = append(out.Closed, closedOf(p.Queue, windowed, d))
		}
	}
	if err == nil && len(plan.Take) > 0 {
		var open []Claimed
		b = &pgx.Batch{}
		b.Queue("BEGIN")
		claimWrite(b, p, &plan, windowed, &open)
		b.Queue("COMMIT")
		if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
			out.WindowsErr = fmt.Errorf("move %d open jobs with time windows: %w", len(plan.Take), err)
		} else {
			out.Jobs = append(out.Jobs, open...)
		}
	}
	// The open jobs among the others, in the queue's order.
	slices.SortFunc(out.Jobs, func(a, b Claimed) int { return p.Order.Compare(keys[a.ID], keys[b.ID]) })
	return out, nil
}

// unboundedSQL is the claim of a queue without limits, of n types (named
// arguments: queue, limit, instance, windowed: the types with windows,
// type_0 …): the due jobs in the queue's order, locked; those without
// time windows moved to running with their attempt rows. It returns, in
// the queue's order, a row per job locked: moved (true, its
// claimColumns) or with windows (false: not moved; its id, type, state,
// attempt, expiry and windows), each with now(), its scheduled_run_time
// and priority.
func unboundedSQL(o correlator.Order, n int, dist bool) string {
	order := orderSQL(o, "j")
	var read string
	if n == 1 || dist {
		// (On Citus, whose planner would run the merge of several types'
		// reads apart from the lock and fail to read its result back,
		// the types' due jobs are read together, on the worker.)
		types := make([]string, n)
		for i := range types {
			types[i] = fmt.Sprintf("@type_%d", i)
		}
		is := "= " + types[0]
		if n > 1 {
			is = "IN (" + strings.Join(types, ", ") + ")"
		}
		read = fmt.Sprintf(`SELECT j.id, j.state, j.attempt, j.job_type, j.expires_at, j.time_windows, j.scheduled_run_time, j.priority
			FROM hipq_job j
			WHERE j.queue = @queue AND j.job_type %s AND %s
			  AND NOT EXISTS (SELECT 1 FROM hipq_queue q WHERE q.name = @queue AND q.paused)
			ORDER BY %s LIMIT @limit FOR UPDATE SKIP LOCKED`, is, dueSQL, order)
	} else {
		// Each type's first due jobs from its own range of the due index,
		// merged in the queue's order (a Merge Append, which reads each type
		// only as far as the merge takes it), then locked: rows locked in
		// each type's read would make every type lock a whole batch. The
		// merge reads twice the batch, so a row another claim holds is
		// passed over for the next (two claims of the same types at once
		// both take a whole batch).
		branches := make([]string, n)
		for i := range branches {
			branches[i] = fmt.Sprintf(`(SELECT j.id, j.scheduled_run_time, j.priority FROM hipq_job j
				WHERE j.queue = @queue AND j.job_type = @type_%d AND %s ORDER BY %s LIMIT 2 * @limit::int)`, i, dueSQL, order)
		}
		read = fmt.Sprintf(`SELECT j.id, j.state, j.attempt, j.job_type, j.expires_at, j.time_windows, j.scheduled_run_time, j.priority
			FROM (SELECT m.id, m.scheduled_run_time, m.priority FROM (%s) m ORDER BY %s LIMIT 2 * @limit::int) m
			JOIN hipq_job j ON j.queue = @queue AND j.id = m.id
			WHERE %s AND NOT EXISTS (SELECT 1 FROM hipq_queue q WHERE q.name = @queue AND q.paused)
			ORDER BY %s LIMIT @limit
			FOR UPDATE OF j SKIP LOCKED`, strings.Join(branches, " UNION ALL "), orderSQL(o, "m"), dueSQL, orderSQL(o, "m"))
	}
	return fmt.Sprintf(`/* claim */ WITH c AS (%s
	), moved AS (
		UPDATE hipq_job j
		SET state = 'running', attempt = j.attempt + 1, started_at = now(), update_time = now(), error = 'NONE'
		FROM c
		WHERE j.queue = @queue AND j.id = c.id AND j.state = c.state AND j.attempt = c.attempt
		  AND c.time_windows IS NULL AND NOT c.job_type = ANY(@windowed)
		RETURNING %s, j.scheduled_run_time, j.priority
	), att AS (
		INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at)
		SELECT @queue, m.id, m.attempt, @instance, m.started_at FROM moved m
	)
	SELECT * FROM (
		SELECT true AS moved, m.id, m.job_type, m.job_key, m.job_data, m.state, m.attempt, m.max_attempts,
		       m.timeout_seconds, m.expires_at, m.time_windows, m.started_at, now(), m.scheduled_run_time, m.priority
		FROM moved m
		UNION ALL
		SELECT false, c.id, c.job_type, '', NULL, c.state, c.attempt, 0, 0, c.expires_at, c.time_windows, now(), now(),
		       c.scheduled_run_time, c.priority
		FROM c
		WHERE c.time_windows IS NOT NULL OR c.job_type = ANY(@windowed)
	) x ORDER BY %s`, read, claimColumns, orderSQL(o, "x"))
}

// claimWrite queues on b the write of plan, made of cands: its takes
// moved to running, each guarded by the state, attempt and
// scheduled_run_time it was read in (a job deferred since is not moved)
// and by its expiry (compared with the values read, not with the
// constants of a due job, so no partial index of due jobs is walked
// instead of the key), with their attempt
// rows and rate units, in one statement. The jobs moved are added to out,
// in the plan's order: a job another writer moved since it was read is
// not.
func claimWrite(b *pgx.Batch, p JobClaimParams, plan *correlator.ClaimPlan, cands []candidate, out *[]Claimed) {
	n := len(plan.Take)
	ids, states, atts, sched := make([]int64, n), make([]string, n), make([]int32, n), make([]time.Time, n)
	pos := make(map[int64]int, n)
	for i, t := range plan.Take {
		ids[i], states[i], atts[i], sched[i] = t.ID, string(t.State), int32(t.Attempt), cands[t.Index].scheduled
		pos[t.ID] = i
	}
	rates, parts, jobs := []string{}, []string{}, []int64{}
	for _, u := range plan.Units {
		for _, k := range u.Takes {
			rates, parts, jobs = append(rates, u.Window.Key), append(parts, u.Window.Part), append(jobs, plan.Take[k].ID)
		}
	}
	b.Queue(claimWriteSQL, pgx.NamedArgs{"queue": p.Queue, "instance": p.Instance, "ids": ids, "states": states, "attempts": atts,
		"scheduled":  sched,
		"unit_rates": rates, "unit_parts": parts, "unit_jobs": jobs}).Query(func(rows pgx.Rows) error {
		var r claimedRow
		moved := make([]Claimed, 0, n)
		if _, err := pgx.ForEachRow(rows, r.dest(), func() error {
			moved = append(moved, r.claimed(p.Queue))
			return nil
		}); err != nil {
			return err
		}
		slices.SortFunc(moved, func(a, b Claimed) int { return cmp.Compare(pos[a.ID], pos[b.ID]) })
		*out = append(*out, moved...)
		return nil
	})
}

// rateCountsCTE adds the requests of the rate units a statement writes (its
// CTE units, returning queue, rate, part and n) to their windows' counts.
// A new window's row takes its units' queue (a window's units are all of
// one queue: a rate belongs to one); the conflict is named by the key's
// constraint, which is (rate, part) on one PostgreSQL and (queue, rate,
// part) on Citus, so the text is the same on both.
const rateCountsCTE = `counts AS (
	    INSERT INTO hipq_rate_count (queue, rate, part, n)
	    SELECT min(units.queue), units.rate, units.part, sum(units.n) FROM units GROUP BY 2, 3
	    ON CONFLICT ON CONSTRAINT hipq_rate_count_pkey DO UPDATE SET n = hipq_rate_count.n + EXCLUDED.n
	)`

// claimWriteSQL is claimWrite's statement.
const claimWriteSQL = `/* claim write */ WITH pick AS (
	    SELECT * FROM unnest(@ids::bigint[], @states::text[], @attempts::int[], @scheduled::timestamptz[])
	        AS p(id, state, attempt, scheduled_run_time)
	), moved AS (
	    UPDATE hipq_job j
	    SET state = 'running', attempt = j.attempt + 1, started_at = now(), update_time = now(), error = 'NONE'
	    FROM pick
	    WHERE j.queue = @queue AND j.id = pick.id AND j.state = pick.state AND j.attempt = pick.attempt
	      AND j.scheduled_run_time = pick.scheduled_run_time AND (j.expires_at IS NULL OR j.expires_at > now())
	    RETURNING ` + claimColumns + `
	), att AS (
	    INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at)
	    SELECT @queue, m.id, m.attempt, @instance, m.started_at FROM moved m
	), units AS (
	    INSERT INTO hipq_rate_unit (queue, claimed_at, rate, part, job_ids, attempts, n)
	    SELECT @queue, now(), u.rate, u.part, array_agg(m.id), array_agg(m.attempt), count(*)
	    FROM unnest(@unit_rates::text[], @unit_parts::text[], @unit_jobs::bigint[]) AS u(rate, part, id)
	    JOIN moved m ON m.id = u.id
	    GROUP BY u.rate, u.part
	    RETURNING queue, rate, part, n
	), ` + rateCountsCTE + `
	SELECT m.* FROM moved m`

// rateSettleSQL settles a queue's rate units under its claim lock (named
// arguments: queue, keys and secs, the rates' keys and periods in
// seconds), in two statements, each followed by rateZeroSQL.
//
// A unit is the requests of one claim (claimed_at: its started_at)
// under one window. Units not yet timed are settled here, under the
// lock, so no hot path pays for rates. A request counts while it
// may be in flight; then until period after the moment it may have
// arrived: its acknowledged send (sent_at), or now for an attempt
// that ended unsent or whose claim is gone (undone after a send in
// doubt, or its job gone): it may have left. Only a request known
// never to have left is given back: its undo left a row in
// hipq_rate_giveback, which is taken out of the unit here. An
// attempt row counts for a unit only when it is the unit's own
// claim's (a later claim reuses an undone claim's attempt number).
// A unit left with no request goes at once, and so does a window
// whose count falls to 0: what the claim reads is bounded by the
// windows that count.
// (Times are taken when the statement runs, after the lock was
// waited for: later than any end or undo it sees, never the
// transaction's start. A unit written before version 17 has no
// claim; its count is never raised.)
var rateSettleSQL = [...]string{`WITH t AS (
		    SELECT clock_timestamp() AS now
		), m AS (
		    SELECT u.id, u.n, u.claimed_at, x.id AS job_id, x.att, g.job_id IS NOT NULL AS back,
		           g.job_id IS NULL AND a.job_id IS NOT NULL AND a.sent_at IS NULL AND a.outcome IS NULL AS flying,
		           CASE WHEN g.job_id IS NOT NULL THEN NULL
		                WHEN a.job_id IS NULL THEN t.now
		                ELSE coalesce(a.sent_at, CASE WHEN a.outcome IS NOT NULL THEN t.now END) END AS at
		    FROM t, hipq_rate_unit u
		    CROSS JOIN LATERAL unnest(u.job_ids, u.attempts) AS x(id, att)
		    LEFT JOIN hipq_attempt a ON a.queue = @queue AND a.job_id = x.id AND a.attempt = x.att
		                             AND (u.claimed_at IS NULL OR a.dispatched_at = u.claimed_at)
		    LEFT JOIN hipq_rate_giveback g ON g.queue = @queue AND g.job_id = x.id AND g.attempt = x.att
		                                   AND g.claimed_at = u.claimed_at
		    WHERE u.rate = ANY(@keys::text[]) AND u.at IS NULL
		), counted_m AS (
		    SELECT m.id, m.n, m.claimed_at, (count(*) FILTER (WHERE NOT m.back))::int AS left_n, bool_or(m.flying) AS flying,
		           max(m.at) AS at,
		           coalesce(array_agg(m.job_id) FILTER (WHERE NOT m.back), '{}') AS ids,
		           coalesce(array_agg(m.att) FILTER (WHERE NOT m.back), '{}') AS atts
		    FROM m GROUP BY m.id, m.n, m.claimed_at
		), open AS (
		    SELECT c.id, c.n, c.flying, c.at, c.ids, c.atts,
		           CASE WHEN c.claimed_at IS NULL THEN least(c.n, c.left_n) ELSE c.left_n END AS present
		    FROM counted_m c
		), taken AS (
		    DELETE FROM hipq_rate_giveback g USING m
		    WHERE m.back AND g.queue = @queue AND g.job_id = m.job_id AND g.attempt = m.att AND g.claimed_at = m.claimed_at
		), fixed AS (
		    UPDATE hipq_rate_unit u
		    SET n = o.present, job_ids = o.ids, attempts = o.atts,
		        at = CASE WHEN o.present = 0 THEN '-infinity' WHEN o.flying THEN NULL ELSE coalesce(o.at, clock_timestamp()) END
		    FROM open o
		    WHERE u.id = o.id AND (o.present <> o.n OR NOT o.flying)
		    RETURNING u.rate, u.part, o.n - o.present AS gone
		), counted AS (
		    UPDATE hipq_rate_count c SET n = c.n - g.n
		    FROM (SELECT fixed.rate, fixed.part, sum(fixed.gone)::int AS n FROM fixed GROUP BY 1, 2) g
		    WHERE c.rate = g.rate AND c.part = g.part AND g.n <> 0
		    RETURNING c.rate, c.part, c.n
		)
		SELECT count(*) FROM counted`, `WITH gone AS (
		    DELETE FROM hipq_rate_unit u
		    USING unnest(@keys::text[], @secs::float8[]) AS q(key, secs)
		    WHERE u.rate = q.key AND u.at <= now() - make_interval(secs => q.secs)
		    RETURNING u.rate, u.part, u.n
		), counted AS (
		    UPDATE hipq_rate_count c SET n = c.n - g.n
		    FROM (SELECT gone.rate, gone.part, sum(gone.n)::int AS n FROM gone GROUP BY 1, 2) g
		    WHERE c.rate = g.rate AND c.part = g.part AND g.n <> 0
		    RETURNING c.rate, c.part, c.n
		)
		SELECT count(*) FROM counted`}

// rateZeroSQL deletes the windows whose count fell to 0.
const rateZeroSQL = `DELETE FROM hipq_rate_count c WHERE c.rate = ANY(@keys::text[]) AND c.n <= 0`

// rateUsageSQL reads the windows that count, each with the moment its
// oldest timed unit frees.
const rateUsageSQL = `SELECT c.rate, c.part, c.n,
			    (SELECT min(u.at) FROM hipq_rate_unit u WHERE u.rate = c.rate AND u.part = c.part AND u.at IS NOT NULL)
			FROM hipq_rate_count c WHERE c.rate = ANY(@keys::text[]) AND c.n > 0`

// The rate statements' forms on Citus, where hipq_rate_unit and
// hipq_rate_count are distributed by queue: every read and write of them
// names the claim's queue, so each statement runs on the queue's shards
// alone. On one PostgreSQL a rate's units and counts are found by its key
// alone: a rate belongs to one queue, and a job type moved to another
// queue keeps counting its windows there. On Citus they are the queue's: a
// type moved to another queue starts its windows afresh in it.
var (
	rateSettleCitusSQL = [...]string{rateSettleForCitus(0), rateSettleForCitus(1)}
	rateZeroCitusSQL   = mustReplace(rateZeroSQL, "WHERE c.rate = ANY", "WHERE c.queue = @queue AND c.rate = ANY")
	rateUsageCitusSQL  = replaceEach(rateUsageSQL,
		"WHERE u.rate = c.rate", "WHERE u.queue = @queue AND u.rate = c.rate",
		"WHERE c.rate = ANY", "WHERE c.queue = @queue AND c.rate = ANY")
)

// rateSettleForCitus is rateSettleSQL[i]'s form on Citus, which refuses,
// in an update or a delete of a distributed table, a volatile function
// (the settle's clock_timestamp()), a stable one of a column (the prune's
// now() minus a rate's period) and any but an immutable one under a CASE
// or a coalesce. So the settle times its units by statement_timestamp(),
// the start of the statement, read beside the units: after the claim lock
// was waited for too (the statement before it in the claim's batch). And
// the prune reads the units past their period first, then deletes them by
// id.
func rateSettleForCitus(i int) string {
	stmt := rateSettleSQL[i]
	if i == 0 {
		stmt = replaceEach(stmt,
			"WHERE u.rate = ANY(@keys::text[]) AND u.at IS NULL", "WHERE u.queue = @queue AND u.rate = ANY(@keys::text[]) AND u.at IS NULL",
			"WHERE u.id = o.id AND", "WHERE u.queue = @queue AND u.id = o.id AND",
			"SELECT clock_timestamp() AS now", "SELECT statement_timestamp() AS now",
			"SELECT c.id, c.n, c.flying, c.at,", "SELECT c.id, c.n, c.flying, c.at, t.now,",
			"FROM counted_m c\n", "FROM counted_m c, t\n",
			"coalesce(o.at, clock_timestamp())", "coalesce(o.at, o.now)")
	} else {
		stmt = mustReplace(stmt, `WITH gone AS (
		    DELETE FROM hipq_rate_unit u
		    USING unnest(@keys::text[], @secs::float8[]) AS q(key, secs)
		    WHERE u.rate = q.key AND u.at <= now() - make_interval(secs => q.secs)`, `WITH past AS (
		    SELECT u.id FROM hipq_rate_unit u, unnest(@keys::text[], @secs::float8[]) AS q(key, secs)
		    WHERE u.queue = @queue AND u.rate = q.key AND u.at <= now() - make_interval(secs => q.secs)
		), gone AS (
		    DELETE FROM hipq_rate_unit u USING past
		    WHERE u.queue = @queue AND u.id = past.id`)
	}
	// (Both then count their windows down.)
	return mustReplace(stmt, "WHERE c.rate = g.rate AND", "WHERE c.queue = @queue AND c.rate = g.rate AND")
}

// rateGivebackSQL deletes the give-backs no unit waits for (their units
// were settled, or belong to a rate no longer configured).
const rateGivebackSQL = `DELETE FROM hipq_rate_giveback g
		WHERE g.queue = @queue
		  AND NOT EXISTS (SELECT 1 FROM hipq_rate_unit u
		                  WHERE u.queue = @queue AND u.claimed_at = g.claimed_at AND u.at IS NULL)`

// claimLockSQL is the queue's claim lock: one claimer of a bounded queue
// at a time, across every instance (its key is the one every version of
// hipq takes, so a rolling upgrade never runs two claimers at once).
const claimLockSQL = `SELECT pg_advisory_xact_lock(hashtextextended('hipq_claim/' || current_schema() || '/' || @queue, 0))`

// claimRowLockSQL is the queue's claim lock on Citus, taken after
// claimLockSQL: an advisory lock is held on the node that took it only, so
// claimers connected to different nodes lock the queue's row of
// hipq_claim_lock too, which lies on the queue's shard (on the worker the
// claim runs on: no node more takes part). The row is made by the first
// claim; a second one that finds it being made waits for that claim's end,
// as it would for its lock.
const claimRowLockSQL = `INSERT INTO hipq_claim_lock AS l (queue, claimed_at) VALUES (@queue, now())
	ON CONFLICT (queue) DO UPDATE SET claimed_at = excluded.claimed_at`

// queueUsage queues, on b, what a claim of a queue with limits (in.Throttle)
// reads first: the queue's claim lock, then, under it, PostgreSQL's clock
// (in.Now) and whether the queue is paused, its rate units settled and the
// rate windows that count, and its running jobs' usage (in.Usage). What it
// read holds until the transaction ends: every claim of the queue, the
// dispatcher's or the intake's, takes the lock first. On Citus (dist) the
// lock is a row lock as well (claimRowLockSQL).
func queueUsage(b *pgx.Batch, dist bool, queue string, in *correlator.ClaimInput, paused *bool) {
	t := &in.Throttle
	keys, secs := make([]string, len(t.Rates)), make([]float64, len(t.Rates))
	period := map[string]time.Duration{}
	for i, r := range t.Rates {
		keys[i], secs[i], period[r.Key] = r.Key, r.Period.Seconds(), r.Period
	}
	var sharePath []string
	if t.Shares != nil && t.Limit >= 1 {
		sharePath = t.Shares.Path
	}
	b.Queue(claimLockSQL, pgx.NamedArgs{"queue": queue})
	if dist {
		b.Queue(claimRowLockSQL, pgx.NamedArgs{"queue": queue})
	}
	b.Queue(`SELECT now(), EXISTS (SELECT 1 FROM hipq_queue q WHERE q.name = $1 AND q.paused)`, queue).QueryRow(func(r pgx.Row) error {
		return r.Scan(&in.Now, paused)
	})
	if len(t.Rates) > 0 {
		rargs := pgx.NamedArgs{"queue": queue, "keys": keys, "secs": secs}
		settle, zero, usage := rateSettleSQL, rateZeroSQL, rateUsageSQL
		if dist {
			settle, zero, usage = rateSettleCitusSQL, rateZeroCitusSQL, rateUsageCitusSQL
		}
		for _, q := range settle {
			b.Queue(q, rargs)
			b.Queue(zero, rargs)
		}
		b.Queue(rateGivebackSQL, rargs)
		b.Queue(usage, rargs).Query(func(rows pgx.Rows) error {
			in.Usage.Rates = map[correlator.RateWindow]correlator.RateUsage{}
			var w correlator.RateWindow
			var n int
			var at *time.Time
			_, err := pgx.ForEachRow(rows, []any{&w.Key, &w.Part, &n, &at}, func() error {
				u := correlator.RateUsage{Count: n}
				if at != nil {
					u.FreeAt = at.Add(period[w.Key])
				}
				in.Usage.Rates[w] = u
				return nil
			})
			return err
		})
	}
	if t.CountsRunning() {
		b.Queue(`SELECT j.job_type, j.job_data #>> @share_path::text[], count(*)::int, sum(j.throttle_factor)::int
			FROM hipq_job j WHERE j.queue = @queue AND j.state = 'running' GROUP BY 1, 2`,
			pgx.NamedArgs{"queue": queue, "share_path": sharePath}).Query(func(rows pgx.Rows) error {
			var jobType string
			var share *string
			var n, factor int
			_, err := pgx.ForEachRow(rows, []any{&jobType, &share, &n, &factor}, func() error {
				in.Usage.Add(t, jobType, share, n, factor)
				return nil
			})
			return err
		})
	}
}

// claimBounded claims a queue with limits (see JobClaim).
func (s *Store) claimBounded(ctx context.Context, p JobClaimParams) (Claim, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return Claim{}, err
	}
	committed := false
	defer func() {
		if !committed {
			// A transaction cut short is rolled back before the connection
			// is used again (one the pool cannot tell idle is closed).
			rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, _ = conn.Exec(rctx, "ROLLBACK")
			cancel()
		}
		conn.Release()
	}()
	in := correlator.ClaimInput{Throttle: p.Throttle, Batch: p.Limit, TypeWindows: p.TypeWindows}

	// Round trip 1: the lock, the rate units settled, and what counts.
	var paused bool
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED") // (what it reads under the lock is read after the lock)
	b.Queue(claimSettings)
	queueUsage(b, s.dist, p.Queue, &in, &paused)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return Claim{}, err
	}
	out := Claim{DBNow: in.Now}
	if paused {
		return out, nil
	}

	// Round trip 2 (and more, while the plan would take jobs past the
	// read): the due jobs the limits leave room for, in the queue's order,
	// as many as the claim could still take; should the walk pass jobs
	// over (a partition with less room than they weigh, jobs outside their
	// windows), it reads on after them, up to max(4 x batch, 1000) at a
	// time, so no backlog it passes over starves the jobs behind it.
	var cands []candidate
	var plan correlator.ClaimPlan
	usage := in.Usage
	for pass := 0; pass < 8; pass++ {
		narrow := correlator.NarrowClaim(p.Throttle, usage)
		if narrow.Nothing {
			break
		}
		var after *candidate
		if len(cands) > 0 {
			after = &cands[len(cands)-1]
		}
		fetch := min(p.Limit-len(plan.Take), narrow.Most)
		if pass > 0 {
			fetch = max(p.Limit*4, 1000)
		}
		read, err := claimRead(ctx, conn, p, &narrow, fetch, after)
		if err != nil {
			return Claim{}, err
		}
		cands = append(cands, read...)
		in.Candidates = in.Candidates[:0]
		for i := range cands {
			in.Candidates = append(in.Candidates, cands[i].ClaimCandidate)
		}
		if plan, err = correlator.PlanClaim(in); err != nil {
			return Claim{}, err
		}
		if !plan.More || len(read) < fetch || len(plan.Take) >= p.Limit {
			break
		}
		usage = plan.Add(&in)
	}
	if len(in.Candidates) == 0 {
		// (Nothing read: the plan of no candidates still says when a full
		// rate window frees.)
		if plan, err = correlator.PlanClaim(in); err != nil {
			return Claim{}, err
		}
	}
	out.RateFreeAt = plan.RateFreeAt
	for _, d := range plan.Defer {
		out.Closed = append(out.Closed, closedOf(p.Queue, cands, d))
	}

	// Round trip 3: the plan written; whether due jobs of the claim's
	// types are still waiting (the limits held them back, or the batch was
	// full: new jobs come after them); the commit.
	b = &pgx.Batch{}
	if len(plan.Take) > 0 {
		claimWrite(b, p, &plan, cands, &out.Jobs)
	}
	b.Queue(dueProbeSQL, p.Queue, p.Types).QueryRow(func(r pgx.Row) error { return r.Scan(&out.Held) })
	b.Queue("COMMIT")
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return Claim{}, err
	}
	committed = true
	return out, nil
}

// claimRead reads the due jobs of p's types narrow leaves room for, in the
// queue's order, at most fetch, after the candidate after (nil: from the
// first).
func claimRead(ctx context.Context, conn interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, p JobClaimParams, narrow *correlator.ClaimNarrow, fetch int, after *candidate) ([]candidate, error) {
	t := &p.Throttle
	var types []string
	for _, name := range p.Types {
		if !slices.Contains(narrow.SkipTypes, name) {
			types = append(types, name)
		}
	}
	if len(types) == 0 {
		return nil, nil
	}
	args := pgx.NamedArgs{"queue": p.Queue, "fetch": fetch, "critical": t.Critical, "max_factor": narrow.MaxFactor}
	if len(t.Critical) == 0 {
		args["critical"] = []string{}
	}
	order := orderSQL(p.Order, "j")
	var where []string
	shareCol, parts := valueColumns(t, "j.job_data", args)
	if t.Shares != nil && t.Limit >= 1 {
		listed := make([]string, 0, len(t.Shares.Caps))
		for v := range t.Shares.Caps {
			listed = append(listed, v)
		}
		args["share_path"], args["share_listed"], args["share_full"], args["share_other_full"] = t.Shares.Path, listed,
			append([]string{}, narrow.FullShares...), narrow.OtherFull
		where = append(where, `(j.job_type = ANY(@critical) OR (j.throttle_factor <= @max_factor
			AND CASE WHEN (`+shareCol+`) = ANY(@share_listed::text[])
			         THEN NOT (`+shareCol+`) = ANY(@share_full::text[]) ELSE NOT @share_other_full END))`)
	} else {
		where = append(where, `(j.job_type = ANY(@critical) OR j.throttle_factor <= @max_factor)`)
	}
	for _, f := range narrow.FullParts {
		cond := fmt.Sprintf("%s = ANY(@rate_full_%d::text[])", parts[f.Rate], f.Rate)
		if typ := t.Rates[f.Rate].Type; typ != "" {
			cond = fmt.Sprintf("j.job_type = @rate_type_%d AND %s", f.Rate, cond)
			args[fmt.Sprintf("rate_type_%d", f.Rate)] = typ
		}
		args[fmt.Sprintf("rate_full_%d", f.Rate)] = f.Parts
		where = append(where, "NOT ("+cond+")")
	}
	if after != nil {
		where = append(where, fmt.Sprintf("(%s) > (%s)", order, afterSQL(p.Order)))
		args["after_scheduled"], args["after_priority"], args["after_id"] = after.scheduled, after.priority, after.ID
	}
	partsCol := partsArray(parts)
	branches := make([]string, len(types))
	for i, name := range types {
		args[fmt.Sprintf("type_%d", i)] = name
		branches[i] = fmt.Sprintf(`(SELECT j.id, j.state, j.attempt, j.throttle_factor, j.job_type, j.scheduled_run_time, j.priority,
			       j.expires_at, j.time_windows, %s AS share, %s AS parts
			FROM hipq_job j
			WHERE j.queue = @queue AND j.job_type = @type_%d AND %s AND %s
			ORDER BY %s LIMIT @fetch)`, shareCol, partsCol, i, dueSQL, strings.Join(where, " AND "), order)
	}
	q := "/* claim read */ " + branches[0]
	if len(branches) > 1 {
		q = fmt.Sprintf(`/* claim read */ SELECT * FROM (%s) j ORDER BY %s LIMIT @fetch`, strings.Join(branches, " UNION ALL "), order)
	}
	rows, err := conn.Query(ctx, q, args)
	if err != nil {
		return nil, err
	}
	var out []candidate
	var c correlator.ClaimCandidate
	var state string
	var sched time.Time
	var prio int
	var windows []byte
	_, err = pgx.ForEachRow(rows, []any{&c.ID, &state, &c.Attempt, &c.Factor, &c.JobType, &sched, &prio, &c.ExpiresAt, &windows,
		&c.Share, &c.RateParts}, func() error {
		c.State = correlator.State(state)
		cd := candidateOf(c, windows)
		cd.scheduled, cd.priority = sched, prio
		if cd.ExpiresAt != nil {
			e := *cd.ExpiresAt
			cd.ExpiresAt = &e
		}
		if cd.Share != nil {
			v := *cd.Share
			cd.Share = &v
		}
		cd.RateParts = slices.Clone(c.RateParts)
		out = append(out, cd)
		return nil
	})
	return out, err
}

// valueColumns are what a claim reads of job_data (data, its SQL
// expression) as PostgreSQL's #>> reads it: the share value (NULL without
// shares) and each rate's part (the empty string where the rate has no path); the paths
// they name are added to args.
func valueColumns(t *correlator.Throttle, data string, args pgx.NamedArgs) (share string, parts []string) {
	share = "NULL::text"
	if t.Shares != nil && t.Limit >= 1 {
		share, args["share_path"] = data+" #>> @share_path::text[]", t.Shares.Path
	}
	parts = make([]string, len(t.Rates))
	for k, r := range t.Rates {
		parts[k] = "''"
		if len(r.Path) > 0 {
			parts[k] = fmt.Sprintf("coalesce(%s #>> @rate_path_%d::text[], '')", data, k)
			args[fmt.Sprintf("rate_path_%d", k)] = r.Path
		}
	}
	return share, parts
}

// partsArray is the rate parts as one text[] column.
func partsArray(parts []string) string {
	if len(parts) == 0 {
		return "'{}'::text[]"
	}
	return "ARRAY[" + strings.Join(parts, ", ") + "]::text[]"
}

// afterSQL is the keyset of the candidate a read goes on after, in the
// queue's order (named arguments after_scheduled, after_priority,
// after_id).
func afterSQL(o correlator.Order) string {
	if o == correlator.OrderPriorityFirst {
		return "@after_priority, @after_scheduled, @after_id"
	}
	return "@after_scheduled, @after_priority, @after_id"
}

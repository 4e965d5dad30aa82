package store

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/hipq/hipq/correlator"
)

// queueTables are the tables that would be distributed by queue
// (docs/scaling.md): a statement that writes or locks their rows must
// name one queue for each of them.
var queueTables = []string{"hipq_job", "hipq_attempt"}

// oneQueue is a condition that names one queue: a parameter or a literal.
var oneQueue = regexp.MustCompile(`^(?:\w+\.)?queue = (\$\d+|'(?:[^']|'')*'::text)$`)

// conjuncts splits a plan's condition into the terms ANDed at its top
// level, each without its outer parentheses.
func conjuncts(cond string) []string {
	cond = strings.TrimSpace(cond)
	for len(cond) > 1 && cond[0] == '(' && closing(cond, 0) == len(cond)-1 {
		cond = strings.TrimSpace(cond[1 : len(cond)-1])
	}
	if i := scanParens(cond, 0, func(i, depth int) bool { return depth == 0 && strings.HasPrefix(cond[i:], " AND ") }); i >= 0 {
		return append(conjuncts(cond[:i]), conjuncts(cond[i+5:])...)
	}
	if cond == "" {
		return nil
	}
	return []string{cond}
}

// closing is the index of the parenthesis closing the one at open (-1: none).
func closing(s string, open int) int {
	return scanParens(s, open, func(i, depth int) bool { return s[i] == ')' && depth == 0 })
}

// scanParens walks s from from, outside quoted strings, and returns the
// first index at which stop holds, given the parenthesis depth after that
// byte (-1: none).
func scanParens(s string, from int, stop func(i, depth int) bool) int {
	depth, quoted := 0, false
	for i := from; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\'':
			quoted = !quoted
			continue
		case quoted:
			continue
		case c == '(':
			depth++
		case c == ')':
			depth--
		}
		if stop(i, depth) {
			return i
		}
	}
	return -1
}

// initPlanOutputs are the parameters a plan's InitPlans compute (PostgreSQL
// prints them as $n too): a queue compared with one is not a queue named.
var initPlanOutputs = regexp.MustCompile(`\$\d+`)

// planNode is one node of an EXPLAIN (FORMAT JSON) plan.
type planNode map[string]any

func (n planNode) str(k string) string { s, _ := n[k].(string); return s }

func (n planNode) walk(fn func(planNode)) {
	fn(n)
	kids, _ := n["Plans"].([]any)
	for _, k := range kids {
		if m, ok := k.(map[string]any); ok {
			planNode(m).walk(fn)
		}
	}
}

// explained is one statement's plan as auto_explain logged it.
type explained struct {
	Query string
	Plan  planNode
}

// unroutable says, for a statement that writes or locks rows, each scan of
// a queue table that names no single queue ("" when there is none, or the
// statement only reads).
func (e explained) unroutable() []string {
	writes := false
	e.Plan.walk(func(n planNode) {
		if t := n.str("Node Type"); t == "ModifyTable" || t == "LockRows" {
			writes = true
		}
	})
	if !writes {
		return nil
	}
	computed := map[string]bool{}
	e.Plan.walk(func(n planNode) {
		if name := n.str("Subplan Name"); strings.HasPrefix(name, "InitPlan") {
			for _, p := range initPlanOutputs.FindAllString(name, -1) {
				computed[p] = true
			}
		}
	})
	var bad []string
	e.Plan.walk(func(n planNode) {
		rel := n.str("Relation Name")
		if !slices.Contains(queueTables, rel) || n.str("Node Type") == "ModifyTable" {
			return
		}
		var conds []string
		named := false
		for _, k := range []string{"Index Cond", "Recheck Cond", "TID Cond", "Filter"} {
			if c := n.str(k); c != "" {
				conds = append(conds, c)
				for _, term := range conjuncts(c) {
					m := oneQueue.FindStringSubmatch(term)
					named = named || m != nil && !computed[m[1]]
				}
			}
		}
		if !named {
			bad = append(bad, fmt.Sprintf("%s on %s (%s)", n.str("Node Type"), rel, strings.Join(conds, "; ")))
		}
	})
	return bad
}

// explainStore opens a store whose every statement, nested ones included
// (the claim function's), is explained into plans by auto_explain, as
// custom or generic plans (PL/pgSQL and pgx cache statements: both kinds
// must name the queue), with their actual rows and loops when analyze.
func explainStore(t *testing.T, generic, analyze bool) (ex, plain *Store, plans func() []explained) {
	t.Helper()
	pg, st := planStore(t)
	pc, err := pgxpool.ParseConfig(pg.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var seen []explained
	pc.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		_, js, ok := strings.Cut(n.Message, "plan:\n")
		if !ok {
			return
		}
		var e struct {
			Query string   `json:"Query Text"`
			Plan  planNode `json:"Plan"`
		}
		if err := json.Unmarshal([]byte(js), &e); err != nil {
			t.Errorf("a plan auto_explain logged is not JSON: %v\n%s", err, js)
			return
		}
		mu.Lock()
		seen = append(seen, explained{e.Query, e.Plan})
		mu.Unlock()
	}
	mode := "force_custom_plan"
	if generic {
		mode = "force_generic_plan"
	}
	pc.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		for _, set := range []string{"LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
			"SET auto_explain.log_nested_statements = on", "SET auto_explain.log_format = json", "SET auto_explain.log_buffers = on",
			"SET auto_explain.log_level = notice", "SET plan_cache_mode = " + mode,
			fmt.Sprintf("SET auto_explain.log_analyze = %v", analyze)} {
			if _, err := c.Exec(ctx, set); err != nil {
				return fmt.Errorf("%s: %w", set, err)
			}
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err == nil {
		err = pool.Ping(context.Background())
	}
	if err != nil {
		t.Skipf("auto_explain is not available here (%v): plans cannot be read", err)
	}
	t.Cleanup(pool.Close)
	return &Store{pool: pool, schema: st.schema, writes: st.writes}, st, func() []explained {
		mu.Lock()
		defer mu.Unlock()
		out := seen
		seen = nil
		return out
	}
}

// Every statement hipq runs to claim, send, resolve and sweep jobs that
// writes or locks rows of hipq_job or hipq_attempt names one queue for
// each (docs/scaling.md): with the tables distributed by queue, each is a
// single-shard statement. Reads that only find what to do may span
// queues (a multi-shard read). The statements are not listed here: the
// whole life of jobs in three queues runs through a store that explains
// every statement it runs, nested ones included, so a statement added
// or changed later is checked too.
func TestEveryWriteNamesItsQueue(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ generic, events bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
		name := map[bool]string{false: "custom plans", true: "generic plans"}[c.generic] + map[bool]string{true: ", events on"}[c.events]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			st, plain, plans := explainStore(t, c.generic, false)
			if c.events {
				// The statements that end jobs, with their events' CTE.
				routes := map[string]correlator.Events{}
				for _, q := range []string{"a", "b", "c"} {
					routes["t"+q] = correlator.Events{Topic: "ev", Attempts: true}
				}
				st = st.WithEvents(Events{Routes: routes, ReplyTo: true})
			}
			queueLife(t, st, plain)
			seen := 0
			for _, e := range plans() {
				writes := false
				e.Plan.walk(func(n planNode) {
					if t := n.str("Node Type"); t == "ModifyTable" || t == "LockRows" {
						writes = true
					}
				})
				if writes {
					seen++
				}
				if bad := e.unroutable(); len(bad) > 0 {
					t.Errorf("a statement that writes or locks names no single queue for:\n  %s\nstatement:\n%s",
						strings.Join(bad, "\n  "), strings.TrimSpace(e.Query))
				}
			}
			if seen < 20 {
				t.Fatalf("only %d statements that write or lock were explained", seen)
			}
		})
	}
}

// queueLife runs jobs of queues a, b (no limits) and c (a throttle and a
// rate) through every path that moves them: claims (in both orders, and
// of jobs outside their windows), send marks, undos, deliveries, replies
// (by key, by id, progress, early, to a final job), resolves, cancels,
// timeouts, unsent claims, expiry, bulk run-now and cancel, and retention. Each step checks that it
// did something, so no statement passes by matching nothing. The jobs are
// inserted, and the clock moved, through plain: intake is not checked
// (its insert finds a (type, key)'s job in any queue, as the uniqueness
// of non-final jobs is per type and key, whatever their queue).
//
// On Citus (st.dist) the jobs are inserted through st, checked too: there
// the intake writes one statement per queue of its batch
// (jobsInsertDistributed). Queue c has a throttle and a rate; once its
// jobs are done, it is claimed twice more, so its rate units are settled
// and counted down, and then pruned past their period.
func queueLife(t *testing.T, st, plain *Store) {
	t.Helper()
	ctx := context.Background()
	intake := plain
	if st.dist {
		intake = st
	}
	retry := &correlator.Backoff{Attempts: 3, Initial: time.Minute,
		When: []correlator.AttemptOutcome{correlator.AttemptFailed, correlator.AttemptTimedOut, correlator.AttemptDispatchError}}
	types := correlator.Types{}
	for _, q := range []string{"a", "b", "c"} {
		types["t"+q] = &correlator.JobType{Name: "t" + q, Queue: q, Timeout: time.Hour, Priority: 100, ThrottleFactor: 1,
			Delivery: correlator.AtLeastOnce, Retry: retry}
	}
	now := time.Now().UTC()
	closed := []correlator.TimeWindow{{Start: now.Add(-2 * time.Hour).Format("15:04"), End: now.Add(-time.Hour).Format("15:04"), TZ: "UTC"}}
	past := now.Add(-time.Minute)
	var jobs []*correlator.Job
	for _, q := range []string{"a", "b", "c"} {
		for i := range 8 {
			j := &correlator.Job{Queue: q, JobType: "t" + q, JobKey: fmt.Sprintf("%s%d", q, i), JobData: json.RawMessage(`{"i":1}`),
				MaxAttempts: 3, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: now.Add(-time.Second)}
			switch i {
			case 6:
				j.TimeWindows = closed
			case 7:
				j.ExpiresAt, j.ScheduledRunTime = &past, now.Add(time.Hour)
			}
			jobs = append(jobs, j)
		}
	}
	if _, err := intake.JobsInsert(ctx, jobs); err != nil {
		t.Fatal(err)
	}
	must := func(what string, n, want int, err error) {
		t.Helper()
		if err != nil || n != want {
			t.Fatalf("%s: %d, want %d (%v)", what, n, want, err)
		}
	}
	throttle := correlator.Throttle{Limit: 50}
	rate, err := correlator.NewRate("q:c#0", 100, time.Minute, "", "")
	if err != nil {
		t.Fatal(err)
	}
	throttle.Rates = []correlator.Rate{rate}
	claims := map[string]Claim{}
	for q, p := range map[string]JobClaimParams{
		"a": {Order: correlator.OrderScheduledFirst},
		"b": {Order: correlator.OrderPriorityFirst},
		"c": {Throttle: throttle},
	} {
		p.Queue, p.Limit, p.Instance = q, 10, "i"
		c, err := st.JobClaim(ctx, p)
		must("claim "+q, len(c.Jobs), 6, err)
		claims[q] = c
		var ds []Deferral
		for _, x := range c.Closed {
			ds = append(ds, Deferral{Queue: q, ID: x.ID, State: x.State, Attempt: x.Attempt, RunAt: now.Add(time.Hour)})
		}
		n, err := st.JobDefer(ctx, ds)
		must("defer "+q, n, 1, err)
	}
	a, b, c := claims["a"].Jobs, claims["b"].Jobs, claims["c"].Jobs
	must("traces", 0, 0, st.AttemptTracesWrite(ctx, []AttemptTrace{{a[0].Ref(), "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}))
	must("mark sent", 0, 0, st.AttemptMarkSent(ctx, []AttemptRef{a[0].Ref(), a[1].Ref(), a[2].Ref(), c[0].Ref()}))
	n, err := st.JobUndoClaim(ctx, []AttemptRef{a[3].Ref()})
	must("undo", n, 1, err)
	// b: a delivery with every part, and a sync reply by job id.
	id, att := b[3].ID, b[3].Attempt
	res, err := st.DeliveryRecord(ctx, Delivery{
		Sent:     []AttemptRef{b[0].Ref(), b[1].Ref(), b[2].Ref(), b[3].Ref()},
		Undo:     []AttemptRef{b[4].Ref()},
		Resolves: []Resolve{{Queue: "b", JobID: b[5].ID, Attempt: b[5].Attempt, Res: correlator.Resolution{State: correlator.StateFinal, Outcome: correlator.OutcomeFailed, Attempt: correlator.AttemptDispatchError, Error: "refused"}}},
		Replies:  []ReplyIn{{Reply: &correlator.Reply{JobID: &id, Attempt: &att, Success: true}, Kind: SourceCallback}},
	}, types)
	must("delivery undone", res.Undone, 1, err)
	must("delivery replies", len(res.Replies.Applied), 1, nil)
	// Replies: by key, a progress report, by job id alone, one that comes
	// before its job is sent (kept), one for a job that ended.
	byKey := func(jt, key string, ok bool) ReplyIn {
		return ReplyIn{Reply: &correlator.Reply{JobType: jt, JobKey: key, Success: ok, Retryable: true, Error: map[bool]string{false: "no"}[ok]},
			Kind: SourceReply, Source: Source{Topic: "r"}}
	}
	progress := byKey("ta", "a1", false)
	progress.Reply.Progress, progress.Reply.Result = true, json.RawMessage(`{"p":1}`)
	idOnly := ReplyIn{Reply: &correlator.Reply{JobID: &b[0].ID, Success: true}, Kind: SourceReply}
	rr, err := st.ReplyApply(ctx, ReplyBatch{Group: "g", EarlyTTL: time.Hour, Replies: []ReplyIn{
		byKey("ta", "a0", true), progress, idOnly, byKey("tb", "b1", false), byKey("ta", "a4", true), byKey("tb", "b3", true),
		byKey("ta", "later", true), byKey("tb", "never-b", true), byKey("tc", "never-c", true),
	}}, types)
	must("replies applied", len(rr.Applied), 4, err)
	must("replies kept", rr.Counts()[correlator.Early], 3, nil)
	must("progress", rr.Counts()[correlator.Progressed], 1, nil)
	must("duplicates", rr.Counts()[correlator.Duplicate], 1, nil)
	// The kept reply's job comes, is claimed and sent: the reply applies.
	later := *jobs[0]
	later.JobKey = "later"
	if _, err := intake.JobsInsert(ctx, []*correlator.Job{&later}); err != nil {
		t.Fatal(err)
	}
	again, err := st.JobClaim(ctx, JobClaimParams{Queue: "a", Limit: 10, Instance: "i"})
	must("claim a again (the undone and the new job)", len(again.Jobs), 2, err)
	var sent []AttemptRef
	for _, j := range again.Jobs {
		sent = append(sent, j.Ref())
	}
	er, err := st.DeliveryRecord(ctx, Delivery{Sent: sent}, types)
	must("early reply applied", len(er.Early.Applied), 1, err)
	// The sweep keeps the two of queues b and c whose jobs never come,
	// then dead-letters them past their TTL.
	sw, _, err := st.EarlyReplySweep(ctx, 0, 100, types)
	must("early replies swept and kept", sw.Counts()[correlator.Early], 2, err)
	if _, err := plain.pool.Exec(ctx, "UPDATE hipq_early_reply SET expires_at = now() - interval '1s'"); err != nil {
		t.Fatal(err)
	}
	sw, _, err = st.EarlyReplySweep(ctx, 0, 100, types)
	must("early replies dead-lettered", len(sw.DeadLetters), 2, err)
	done, err := st.JobResolveMany(ctx, []Resolve{{Queue: "c", JobID: c[0].ID, Attempt: c[0].Attempt, Sent: true,
		Res: correlator.Resolution{State: correlator.StateFinal, Outcome: correlator.OutcomeSucceeded, Attempt: correlator.AttemptSucceeded}}})
	must("resolve", len(done), 1, err)
	if _, err := st.JobCancel(ctx, "tc", c[1].JobKey); err != nil {
		t.Fatal(err)
	}
	// The sweeper: c[2] sent and timed out, c[3] claimed long ago and never sent.
	// (By queue too, as Citus runs a write with a join only on one shard.)
	if _, err := plain.pool.Exec(ctx, `WITH j AS (UPDATE hipq_job SET started_at = now() - interval '2 hours' WHERE queue = 'c' AND id = $1 RETURNING id)
		UPDATE hipq_attempt a SET sent_at = now() - interval '2 hours' FROM j WHERE a.queue = 'c' AND a.job_id = j.id`, c[2].ID); err != nil {
		t.Fatal(err)
	}
	if _, err := plain.pool.Exec(ctx, `WITH j AS (UPDATE hipq_job SET started_at = now() - interval '30 minutes' WHERE queue = 'c' AND id = $1 RETURNING id)
		UPDATE hipq_attempt a SET dispatched_at = now() - interval '30 minutes' FROM j WHERE a.queue = 'c' AND a.job_id = j.id`, c[3].ID); err != nil {
		t.Fatal(err)
	}
	out, err := st.JobTimeOutStuck(ctx, 100, types)
	must("timed out", len(out), 1, err)
	unsent, _, err := st.AttemptFindUnsent(ctx, types, time.Second, 100, nil)
	if err != nil || !slices.ContainsFunc(unsent, func(u Unsent) bool { return u.JobID == c[3].ID }) {
		t.Fatalf("unsent: %v %v", unsent, err)
	}
	var refs []AttemptRef
	for _, u := range unsent {
		refs = append(refs, u.AttemptRef)
	}
	n, err = st.JobUndoClaim(ctx, refs)
	must("undo unsent", n, len(refs), err)
	n, err = st.JobExpire(ctx, 100)
	must("expired", n, 3, err)
	// Queue c's rate: its unit settled (the requests undone unsent given
	// back), then, timed past its period, pruned with its window.
	rates := func() (units, windows int) {
		t.Helper()
		if err := plain.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM hipq_rate_unit WHERE queue = 'c'),
			(SELECT count(*) FROM hipq_rate_count WHERE queue = 'c')`).Scan(&units, &windows); err != nil {
			t.Fatal(err)
		}
		return units, windows
	}
	if u, w := rates(); u == 0 || w != 1 {
		t.Fatalf("queue c's rate: %d units, %d windows, want some and 1", u, w)
	}
	claimC := func() {
		t.Helper()
		if _, err := st.JobClaim(ctx, JobClaimParams{Queue: "c", Limit: 10, Instance: "i", Throttle: throttle}); err != nil {
			t.Fatal(err)
		}
	}
	claimC()
	var backs int
	if err := plain.pool.QueryRow(ctx, "SELECT count(*) FROM hipq_rate_giveback WHERE queue = 'c'").Scan(&backs); err != nil || backs != 0 {
		t.Fatalf("%d give-backs left after a claim of queue c (%v)", backs, err)
	}
	if _, err := plain.pool.Exec(ctx, "UPDATE hipq_rate_unit SET at = now() - interval '2 minutes' WHERE queue = 'c'"); err != nil {
		t.Fatal(err)
	}
	claimC()
	if u, w := rates(); u != 0 || w != 0 {
		t.Fatalf("queue c's rate past its period: %d units, %d windows, want none", u, w)
	}
	// Bulk actions by filter: a run-now of the jobs waiting (those of
	// closed windows, deferred to their opening), then a cancel of every
	// job not final, each in batches of 4, across the three queues.
	before := time.Now()
	for _, kind := range []OperationKind{OperationRunNow, OperationCancel} {
		op, err := st.OperationCreate(ctx, Operation{Kind: kind, Reason: "queue life", TokenName: "t",
			Jobs: &JobFilter{CreatedBefore: &before}}, "i", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		for op.State == OperationRunning {
			if op, err = st.OperationStep(ctx, op.ID, OperationWork{Owner: "i", Lease: time.Minute, Batch: 4}); err != nil {
				t.Fatal(err)
			}
		}
		if op.Done == 0 {
			t.Fatalf("%s: did nothing (matched %d)", kind, op.Matched)
		}
	}
	// Every attempt written carries its job's queue: none has no job in
	// its own queue. (A join by queue, which Citus runs shard by shard.)
	var wrong int
	err = plain.pool.QueryRow(ctx, `SELECT count(*) FROM hipq_attempt a
		WHERE NOT EXISTS (SELECT 1 FROM hipq_job j WHERE j.queue = a.queue AND j.id = a.job_id)`).Scan(&wrong)
	must("attempts without their job in their queue", wrong, 0, err)
	if n, err = st.JobPrune(ctx, 0, 100); err != nil || n < 8 {
		t.Fatalf("pruned %d: %v", n, err)
	}
}

func TestConjuncts(t *testing.T) {
	for cond, want := range map[string][]string{
		"((queue = $1) AND (id = ANY ($2)))":                     {"queue = $1", "id = ANY ($2)"},
		"(((queue = $1) OR (job_key = $1)) AND (id = 1))":        {"(queue = $1) OR (job_key = $1)", "id = 1"},
		"(queue = 'a AND b'::text)":                              {"queue = 'a AND b'::text"},
		"((j.queue = $3) AND ((state = 'x') AND (attempt = 2)))": {"j.queue = $3", "state = 'x'", "attempt = 2"},
		"((a = 1) OR (b = 2))":                                   {"(a = 1) OR (b = 2)"},
	} {
		if got := conjuncts(cond); !slices.Equal(got, want) {
			t.Errorf("conjuncts(%q) = %q, want %q", cond, got, want)
		}
	}
}

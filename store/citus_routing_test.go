package store

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/citustest"
)

// stillSpans are the statements hipq sends on Citus that write shards of
// several queues, each with why; the test fails when one of them writes
// one queue's only, to be taken off this list.
var stillSpans = map[string]string{}

// lifeQueues are the queues queueLife runs jobs in.
var lifeQueues = []string{"a", "b", "c"}

// Every statement hipq sends that writes or locks rows of a distributed
// table (hipq_job, hipq_attempt, hipq_event, hipq_activity, … distributed
// by queue) touches one queue's shards only, on a real Citus cluster (a
// coordinator and two workers): every command Citus sends a worker for it
// that writes or locks (INSERT, UPDATE, DELETE, COPY into a shard,
// SELECT … FOR UPDATE/SHARE) names shards of one queue.
//
// The evidence is Citus's own, citus.log_remote_commands: the store's
// connections run with it on, so the coordinator reports each command it
// sends a worker as a NOTICE ("issuing …"), which the connection's notice
// handler reads and a pgx tracer puts down to the statement hipq was
// running on that connection then. A shard is a queue's when it is
// get_shard_id_for_distribution_column(its table, the queue); the test's
// three queues are on three different shards of each table, so a write of
// two queues' rows names two. Commands on reference tables (hipq_queue,
// hipq_schedule) and on the coordinator's own tables, reads (a read that
// only finds work may span queues) and Citus's transaction bookkeeping
// (BEGIN, assign_distributed_transaction_id, PREPARE TRANSACTION, COMMIT
// PREPARED) write no distributed table's shard.
//
// The statements are not listed: they are those of the whole life of jobs
// in three queues (queueLife, as TestEveryWriteNamesItsQueue runs it, with
// the intake's inserts, and a queue with a throttle and a rate; without
// claims at intake, which hipq does not do on Citus) and of the paths it does not run (citusLife: the
// API, schedules, the dashboard's activity, the relay of events), with
// the events of the statements that end jobs and without, so a statement
// added or changed later is checked too. stillSpans names the statements
// known to write several queues' shards, and why. They are planned as
// hipq's are by default (plan_cache_mode auto): Citus plans a statement
// it can route only with its parameters' values (the intake's insert,
// say) generically at a cost PostgreSQL never chooses, and refuses to run
// that plan when forced to (force_generic_plan: "could not create
// distributed plan"). The last sub-test shows that writes of several
// queues' rows, sent through the same capture, are flagged.
func TestEveryWriteRoutesToOneShard(t *testing.T) {
	if !citustest.Enabled() {
		t.Skip("runs on a Citus cluster only: HIPQ_TEST_CITUS=1 (make test-citus) runs it")
	}
	for _, events := range []bool{false, true} {
		t.Run(map[bool]string{false: "events off", true: "events on"}[events], func(t *testing.T) {
			st, plain, capture := routedStore(t)
			if events {
				routes := map[string]correlator.Events{}
				for _, q := range lifeQueues {
					routes["t"+q] = correlator.Events{Topic: "ev", Attempts: true}
				}
				st = st.WithEvents(Events{Routes: routes, ReplyTo: true})
			}
			queueLife(t, st, plain)
			citusLife(t, st, plain, events)
			shards := queueShards(t, plain, lifeQueues)
			written, tables := map[string]int{}, map[string]int{}
			seen := 0
			for _, s := range capture.take() {
				r := shards.route(s)
				if len(r.shards) > 0 {
					seen++
					for _, q := range r.queues {
						written[q]++
					}
					for _, id := range r.shards {
						tables[shards.table[id]]++
					}
				}
				if why, ok := stillSpans[oneLine(s.sql)]; ok {
					if r.bad == "" {
						t.Errorf("%s writes one queue's shards now: take it off stillSpans", oneLine(s.sql))
					} else {
						t.Logf("spans queues still (%s): %s", why, r.bad)
					}
				} else if r.bad != "" {
					t.Errorf("a statement that writes or locks is not a router query of one queue: %s\nstatement: %s\ncommands:\n  %s",
						r.bad, oneLine(s.sql), strings.Join(cutList(r.commands, 4), "\n  "))
				}
			}
			if seen < 30 {
				t.Fatalf("only %d statements wrote or locked a shard (Citus's remote commands not captured?)", seen)
			}
			for _, q := range lifeQueues {
				if written[q] < 5 {
					t.Errorf("only %d statements wrote or locked queue %s's shards, want at least 5: %v", written[q], q, written)
				}
			}
			want := []string{"hipq_job", "hipq_attempt", "hipq_activity", "hipq_early_reply", "hipq_rate_unit", "hipq_rate_count", "hipq_rate_giveback"}
			if events {
				want = append(want, "hipq_event")
			}
			for _, tb := range want {
				if tables[tb] == 0 {
					t.Errorf("no statement wrote or locked a shard of %s: %v", tb, tables)
				}
			}
			t.Logf("%d statements wrote or locked shards, by queue: %v; by table: %v", seen, written, tables)
		})
	}
	t.Run("a write of several queues is flagged", func(t *testing.T) {
		st, plain, capture := routedStore(t)
		shards := queueShards(t, plain, lifeQueues)
		ctx := context.Background()
		for _, stmt := range []string{
			// No queue: every shard of hipq_job.
			"UPDATE hipq_job SET update_time = now() WHERE id = ANY($1)",
			// Two queues: their two shards.
			"UPDATE hipq_job SET update_time = now() WHERE queue IN ('a', 'b') AND id = ANY($1)",
			// Two queues' attempts.
			"DELETE FROM hipq_attempt WHERE queue IN ('b', 'c') AND job_id = ANY($1)",
			// Early replies by id alone (the single-node delete): every shard.
			"DELETE FROM hipq_early_reply WHERE id = ANY($1)",
		} {
			if _, err := st.pool.Exec(ctx, stmt, []int64{1, 2, 3}); err != nil {
				t.Fatalf("%s: %v", stmt, err)
			}
		}
		got := capture.take()
		flagged := 0
		for _, s := range got {
			if r := shards.route(s); r.bad != "" {
				flagged++
				t.Logf("flagged, as it must be: %s: %s", oneLine(s.sql), r.bad)
			}
		}
		if flagged != 4 {
			t.Fatalf("%d of the 4 writes of several queues flagged: %+v", flagged, got)
		}
		// And one queue's write passes.
		if _, err := st.pool.Exec(ctx, "UPDATE hipq_job SET update_time = now() WHERE queue = 'c' AND id = ANY($1)", []int64{1}); err != nil {
			t.Fatal(err)
		}
		got = capture.take()
		if len(got) != 1 {
			t.Fatalf("%d statements seen, want the one: %+v", len(got), got)
		}
		if r := shards.route(got[0]); r.bad != "" || len(r.shards) != 1 || !slices.Equal(r.queues, []string{"c"}) {
			t.Fatalf("a write of queue c: %+v", r)
		}
	})
}

// citusLife runs, through st, the paths of hipq that write jobs, their
// events or the queues' activity and that queueLife does not run: the
// API's enqueue, cancel and replay, a schedule's fire and trigger, the
// activity the dashboard shows, and with events the relay's read and
// delete of the events written. Each step checks that it did something.
func citusLife(t *testing.T, st, plain *Store, events bool) {
	t.Helper()
	ctx := context.Background()
	now := time.Now().UTC()
	jt := func(q string) *correlator.JobType {
		return &correlator.JobType{Name: "t" + q, Queue: q, Timeout: time.Hour, Priority: 100, ThrottleFactor: 1, Delivery: correlator.AtLeastOnce}
	}
	// The API: a job of queue b enqueued, cancelled and replayed.
	j := &correlator.Job{Queue: "b", JobType: "tb", JobKey: "api", JobData: json.RawMessage(`{}`), MaxAttempts: 1, Priority: 100,
		ThrottleFactor: 1, TimeoutSeconds: 60, ScheduledRunTime: now}
	if _, created, err := st.JobEnqueue(ctx, j); err != nil || !created {
		t.Fatalf("enqueue: created %v: %v", created, err)
	}
	if _, err := st.JobCancel(ctx, "tb", "api"); err != nil {
		t.Fatalf("cancel: %v", err)
	}
	if _, err := st.JobReplay(ctx, "tb", "api", jt("b")); err != nil {
		t.Fatalf("replay: %v", err)
	}
	// A schedule of queue c's type: fired (its last fire an hour and
	// more ago), then triggered.
	sch := &correlator.Schedule{Name: "s", Cron: "@every 1h", JobType: "tc", KeyTemplate: "s-{{.Time.Unix}}"}
	if err := sch.Compile(); err != nil {
		t.Fatal(err)
	}
	if err := st.ScheduleSync(ctx, []string{"s"}); err != nil {
		t.Fatal(err)
	}
	if _, err := plain.pool.Exec(ctx, "UPDATE hipq_schedule SET last_fire = $1 WHERE name = 's'", now.Add(-time.Hour-time.Minute)); err != nil {
		t.Fatal(err)
	}
	if f, err := st.ScheduleFire(ctx, sch, jt("c"), now.Add(-24*time.Hour)); err != nil || f.Enqueued != 1 {
		t.Fatalf("schedule fired: %+v, want 1 job enqueued (%v)", f, err)
	}
	if _, created, err := st.ScheduleTrigger(ctx, sch, jt("c")); err != nil || !created {
		t.Fatalf("schedule triggered: created %v: %v", created, err)
	}
	// The activity of the three queues in this minute, after a row of
	// queue a's of more than a day ago (pruned at once).
	if err := st.ActivityAdd(ctx, "i", []Activity{{Minute: now.Add(-26 * time.Hour), Queue: "a", Dispatched: 1}}); err != nil {
		t.Fatal(err)
	}
	var as []Activity
	for _, q := range lifeQueues {
		as = append(as, Activity{Minute: now, Queue: q, Dispatched: 1, Replied: 1})
	}
	if err := st.ActivityAdd(ctx, "i", as); err != nil {
		t.Fatal(err)
	}
	var rows int
	if err := plain.pool.QueryRow(ctx, "SELECT count(*) FROM hipq_activity").Scan(&rows); err != nil || rows != len(lifeQueues) {
		t.Fatalf("%d rows of activity (%v), want %d: the old one pruned", rows, err, len(lifeQueues))
	}
	if !events {
		return
	}
	// The relay: the events of the topic the routes name read and
	// deleted.
	evs, err := st.EventRead(ctx, "ev", 1000)
	if err != nil || len(evs) == 0 {
		t.Fatalf("events: %d (%v)", len(evs), err)
	}
	var refs []EventRef
	for _, e := range evs {
		refs = append(refs, e.Ref())
	}
	if err := st.EventDelete(ctx, refs); err != nil {
		t.Fatal(err)
	}
}

// routedStore opens a store on a new migrated database on the test
// binary's Citus cluster whose connections log the commands Citus sends
// to workers, and plain, one that does not, on the same database.
func routedStore(t *testing.T) (st, plain *Store, c *remoteCapture) {
	t.Helper()
	url := citustest.URL(t)
	ctx := context.Background()
	plain, err := Open(ctx, Config{URL: url, MaxConns: 4, Citus: CitusOn})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(plain.Close)
	if _, err := plain.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	c = &remoteCapture{pending: map[*pgconn.PgConn][]string{}}
	st, err = open(ctx, Config{URL: url, MaxConns: 4, Citus: CitusOn}, func(pc *pgxpool.Config) {
		pc.ConnConfig.RuntimeParams["citus.log_remote_commands"] = "on"
		pc.ConnConfig.RuntimeParams["citus.log_local_commands"] = "on"
		pc.ConnConfig.OnNotice = c.notice
		pc.ConnConfig.Tracer = c
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	if !st.dist {
		t.Fatal("the store does not know it is on Citus")
	}
	return st, plain, c
}

// sentStatement is one statement hipq sent and the commands Citus sent to the
// workers (or ran on a shard of its own) while it ran.
type sentStatement struct {
	sql    string
	remote []string
}

// remoteCapture puts down each command Citus reports sending (a NOTICE of
// citus.log_remote_commands or citus.log_local_commands) to the statement
// running on that connection then. A statement's notices arrive before
// its result, so those a connection received since the result of its
// previous statement belong to the next statement whose result is read:
// pgx's tracer says which (a query's end, or each statement's of a batch,
// read in order).
type remoteCapture struct {
	mu      sync.Mutex
	pending map[*pgconn.PgConn][]string
	stmts   []sentStatement
}

// remoteNotice is a command Citus reports: sent to a worker, or run on a
// shard on the coordinator.
var remoteNotice = regexp.MustCompile(`^(?:issuing|executing the command locally:) (?s)(.*)$`)

func (c *remoteCapture) notice(pc *pgconn.PgConn, n *pgconn.Notice) {
	m := remoteNotice.FindStringSubmatch(n.Message)
	if m == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pending[pc] = append(c.pending[pc], m[1])
}

// done gives the notices pending on conn to sql (always, or only when
// there are some).
func (c *remoteCapture) done(conn *pgx.Conn, sql string, always bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	pc := conn.PgConn()
	if always || len(c.pending[pc]) > 0 {
		c.stmts = append(c.stmts, sentStatement{sql: sql, remote: c.pending[pc]})
	}
	delete(c.pending, pc)
}

// take returns the statements seen so far, and the notices no statement
// ended after, each as a statement of its own (checked as well).
func (c *remoteCapture) take() []sentStatement {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.stmts
	for _, p := range slices.Collect(maps.Values(c.pending)) {
		out = append(out, sentStatement{sql: "(no statement ended after these commands)", remote: p})
	}
	c.stmts, c.pending = nil, map[*pgconn.PgConn][]string{}
	return out
}

type sqlKey struct{}

func (c *remoteCapture) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, sqlKey{}, d.SQL)
}

func (c *remoteCapture) TraceQueryEnd(ctx context.Context, conn *pgx.Conn, _ pgx.TraceQueryEndData) {
	sql, _ := ctx.Value(sqlKey{}).(string)
	c.done(conn, sql, true)
}

func (c *remoteCapture) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *remoteCapture) TraceBatchQuery(_ context.Context, conn *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.done(conn, d.SQL, true)
}

func (c *remoteCapture) TraceBatchEnd(_ context.Context, conn *pgx.Conn, _ pgx.TraceBatchEndData) {
	c.done(conn, "(the end of a batch, after its statements)", false)
}

// shardMap says which of a set of queues each shard of the distributed
// tables holds rows of.
type shardMap struct {
	// queues: shard id → the queues whose rows it holds (none: a shard of
	// no queue of the test's).
	queues map[int64][]string
	// table: shard id → its table.
	table map[int64]string
	// name is a shard's table's name followed by _<shard id>.
	name *regexp.Regexp
}

// queueShards reads the shards of the distributed tables and which of
// queues each holds, and checks that each queue's rows are on a shard of
// their own (so a write of two queues' rows names two shards).
func queueShards(t *testing.T, st *Store, queues []string) shardMap {
	t.Helper()
	ctx := context.Background()
	var tables []string
	for _, tb := range citusLayout {
		if tb.kind == citusDistributed {
			tables = append(tables, tb.name)
		}
	}
	m := shardMap{queues: map[int64][]string{}, table: map[int64]string{},
		name: regexp.MustCompile(`\b(?:` + strings.Join(tables, "|") + `)_(\d+)\b`)}
	rows, err := st.pool.Query(ctx, `SELECT s.shardid, s.logicalrelid::regclass::text FROM pg_dist_shard s
		WHERE s.logicalrelid::regclass::text = ANY($1)`, tables)
	if err != nil {
		t.Fatal(err)
	}
	var id int64
	var table string
	if _, err := pgx.ForEachRow(rows, []any{&id, &table}, func() error {
		m.queues[id], m.table[id] = nil, table
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(m.table) < 2*len(tables) {
		t.Fatalf("%d shards of %d distributed tables: not split by queue", len(m.table), len(tables))
	}
	for _, tb := range tables {
		owner := map[int64]string{}
		for _, q := range queues {
			var id int64
			if err := st.pool.QueryRow(ctx, "SELECT get_shard_id_for_distribution_column($1, $2::text)", tb, q).Scan(&id); err != nil {
				t.Fatal(err)
			}
			if o, ok := owner[id]; ok {
				t.Fatalf("queues %s and %s share shard %d of %s: a write of both would name one shard", o, q, id, tb)
			}
			owner[id] = q
			m.queues[id] = append(m.queues[id], q)
		}
	}
	return m
}

// routing is what a statement's commands wrote or locked.
type routing struct {
	shards   []int64  // the shards its commands wrote or locked, in order
	queues   []string // the queues every one of those shards holds
	commands []string // those commands
	bad      string   // why it is not one queue's ("": it is, or it writes no shard)
}

// route says which shards s's commands that write or lock name, and
// whether they are all one queue's.
func (m shardMap) route(s sentStatement) routing {
	var r routing
	for _, cmd := range s.remote {
		for _, part := range splitCommands(cmd) {
			text := withoutLiterals(part)
			if !writesOrLocks(text) {
				continue
			}
			found := m.name.FindAllStringSubmatch(text, -1)
			if len(found) == 0 {
				continue // a reference table's or a local one's
			}
			r.commands = append(r.commands, oneLine(part))
			for _, f := range found {
				id, err := strconv.ParseInt(f[1], 10, 64)
				if err != nil {
					r.bad = fmt.Sprintf("shard name %s: %v", f[0], err)
				} else if !slices.Contains(r.shards, id) {
					r.shards = append(r.shards, id)
				}
			}
		}
	}
	slices.Sort(r.shards)
	var held, foreign []string
	for i, id := range r.shards {
		qs, ok := m.queues[id]
		switch {
		case !ok:
			r.bad = fmt.Sprintf("shard %d is no shard of a distributed table", id)
		case len(qs) == 0:
			foreign = append(foreign, m.table[id]+"_"+strconv.FormatInt(id, 10))
		}
		held = append(held, fmt.Sprintf("%s_%d: %v", m.table[id], id, qs))
		if i == 0 {
			r.queues = slices.Clone(qs)
		} else {
			r.queues = slices.DeleteFunc(r.queues, func(q string) bool { return !slices.Contains(qs, q) })
		}
	}
	switch {
	case r.bad != "":
	case len(foreign) > 0:
		r.bad = fmt.Sprintf("it writes or locks %d shards, %d of them of none of the queues %v (%s)",
			len(r.shards), len(foreign), lifeQueues, strings.Join(cutList(foreign, 4), ", "))
	case len(r.shards) > 0 && len(r.queues) == 0:
		r.bad = "it writes or locks shards of several queues (" + strings.Join(held, ", ") + ")"
	}
	return r
}

// cutList is the first n of ss, then how many more.
func cutList(ss []string, n int) []string {
	if len(ss) <= n {
		return ss
	}
	return append(slices.Clone(ss[:n]), fmt.Sprintf("and %d more", len(ss)-n))
}

// splitCommands splits what Citus sent in one message (BEGIN …; SELECT
// assign_distributed_transaction_id(…); UPDATE …) into its commands.
func splitCommands(s string) []string {
	var out []string
	quoted, from := false, 0
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == '\'':
			quoted = !quoted
		case s[i] == ';' && !quoted:
			out = append(out, s[from:i])
			from = i + 1
		}
	}
	out = append(out, s[from:])
	return slices.DeleteFunc(out, func(c string) bool { return strings.TrimSpace(c) == "" })
}

// withoutLiterals is s without the text of its string literals (a query a
// command passes as a string, say, is not what it does).
func withoutLiterals(s string) string {
	var b strings.Builder
	quoted := false
	for i := 0; i < len(s); i++ {
		if s[i] == '\'' {
			quoted = !quoted
			b.WriteByte('\'')
			continue
		}
		if !quoted {
			b.WriteByte(s[i])
		}
	}
	return b.String()
}

// A command writes when it is an INSERT, UPDATE, DELETE, MERGE, TRUNCATE
// or COPY into a table, or a WITH whose CTEs do; it locks rows with FOR UPDATE or
// FOR SHARE (of any strength).
var (
	writeCommand = regexp.MustCompile(`(?is)^\s*(?:INSERT|UPDATE|DELETE|MERGE|TRUNCATE)\b|^\s*COPY\s+[^(].*\bFROM\s+STDIN\b`)
	writeCTE     = regexp.MustCompile(`(?is)^\s*WITH\b.*\b(?:INSERT\s+INTO|DELETE\s+FROM|UPDATE\s+\S+(?:\s+(?:AS\s+)?\w+)?\s+SET)\b`)
	lockClause   = regexp.MustCompile(`(?is)\bFOR\s+(?:UPDATE|NO\s+KEY\s+UPDATE|SHARE|KEY\s+SHARE)\b`)
)

func writesOrLocks(cmd string) bool {
	return writeCommand.MatchString(cmd) || writeCTE.MatchString(cmd) || lockClause.MatchString(cmd)
}

// oneLine is s on one line, cut short.
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 240 {
		s = s[:240] + "…"
	}
	return s
}

// The commands of a message of Citus are told apart, and those that write
// or lock from those that read.
func TestRemoteCommands(t *testing.T) {
	for in, want := range map[string][]string{
		"BEGIN TRANSACTION ISOLATION LEVEL READ COMMITTED;SELECT assign_distributed_transaction_id(0, 8, '2025-01-01');": {
			"BEGIN TRANSACTION ISOLATION LEVEL READ COMMITTED", "SELECT assign_distributed_transaction_id(0, 8, '2025-01-01')"},
		"UPDATE public.hipq_job_102008 hipq_job SET error = 'a;b' WHERE (queue = 'a'::text)": {
			"UPDATE public.hipq_job_102008 hipq_job SET error = 'a;b' WHERE (queue = 'a'::text)"},
	} {
		if got := splitCommands(in); !slices.Equal(got, want) {
			t.Errorf("splitCommands(%q) = %q, want %q", in, got, want)
		}
	}
	for cmd, want := range map[string]bool{
		"UPDATE public.hipq_job_102008 hipq_job SET update_time = now()":                                       true,
		"WITH j AS (UPDATE public.hipq_job_102008 j SET state = 'x' RETURNING id) SELECT id FROM j":            true,
		"WITH j AS (SELECT 1) DELETE FROM public.hipq_attempt_102040 a":                                        true,
		"SELECT id FROM public.hipq_job_102008 j WHERE queue = 'a' ORDER BY id LIMIT 3 FOR UPDATE SKIP LOCKED": true,
		"COPY public.hipq_attempt_102040 (queue, job_id) FROM STDIN WITH (format binary)":                      true,
		"SELECT id FROM public.hipq_job_102008 j WHERE queue = 'a'":                                            false,
		"COPY (SELECT 1) TO STDOUT": false,
		"SELECT worker_partition_query_result(" + withoutLiterals("'r', 'UPDATE x SET y = 1'") + ")": false,
		"PREPARE TRANSACTION 'citus_0_1_2_3'":                                                        false,
	} {
		if got := writesOrLocks(cmd); got != want {
			t.Errorf("writesOrLocks(%q) = %v, want %v", cmd, got, want)
		}
	}
}

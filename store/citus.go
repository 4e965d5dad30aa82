package store

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// Values of Config.Citus.
const (
	// CitusAuto lays the schema out for Citus when the citus extension is
	// in the database.
	CitusAuto = "auto"
	CitusOn   = "on"
	CitusOff  = "off"
)

// Citus table kinds.
const (
	citusDistributed = "distributed"
	citusReference   = "reference"
	// citusLocal: a table of the coordinator's, known to Citus's metadata
	// (citus_add_local_table_to_metadata), so that an instance connected
	// to a worker reads and writes it too: Citus routes its statements to
	// the coordinator. A plain local table exists on the coordinator only.
	citusLocal = "local"
)

// citusTable is how one table is laid out on a Citus cluster.
type citusTable struct {
	name string
	kind string
	// keys are the statements that make the table's primary key and
	// unique indexes include queue, the distribution column, as Citus
	// requires of a distributed table. They run only on Citus: a
	// single-node schema keeps its keys.
	keys []string
	// derive, when set, fills the table from others once it is
	// distributed: its rows are derived from theirs, so its own are
	// deleted first and laid out anew, without a copy (and without hipq
	// migrate --distribute).
	derive string
}

// citusLayout is the schema's layout on Citus. The per-queue tables are
// distributed by queue and co-located with hipq_job, so that a statement
// naming one queue runs on one worker; hipq_queue and hipq_schedule, tiny
// and read by every claim and schedule, are copied to every node. Every
// other table is the coordinator's, in Citus's metadata so that instances
// on any node reach it: they are not per queue (offsets, the intake
// outbox, dead letters, sessions, operations, the leases, the migrations'
// records).
var citusLayout = []citusTable{
	{name: "hipq_job", kind: citusDistributed, keys: []string{
		"ALTER TABLE hipq_job DROP CONSTRAINT hipq_job_pkey, ADD CONSTRAINT hipq_job_pkey PRIMARY KEY (queue, id)",
		"DROP INDEX hipq_job_active_key",
		"CREATE UNIQUE INDEX hipq_job_active_key ON hipq_job (queue, job_type, job_key) WHERE state <> 'final'",
	}},
	{name: "hipq_attempt", kind: citusDistributed, keys: []string{
		"ALTER TABLE hipq_attempt DROP CONSTRAINT hipq_attempt_pkey, ADD CONSTRAINT hipq_attempt_pkey PRIMARY KEY (queue, job_id, attempt)",
	}},
	{name: "hipq_rate_unit", kind: citusDistributed, keys: []string{
		// (queue is nullable in the single-node schema; a primary key
		// makes it NOT NULL, as a distribution column must be.)
		"ALTER TABLE hipq_rate_unit DROP CONSTRAINT hipq_rate_unit_pkey, ADD CONSTRAINT hipq_rate_unit_pkey PRIMARY KEY (queue, id)",
	}},
	{name: "hipq_rate_count", kind: citusDistributed, keys: []string{
		// (Its rows are the sums of the units', which derive makes again
		// by queue: a window's units are of one queue on the cluster,
		// while on one PostgreSQL a job type's window follows the type
		// when it changes queue.)
		"DELETE FROM hipq_rate_count",
		"ALTER TABLE hipq_rate_count DROP CONSTRAINT hipq_rate_count_pkey, ADD CONSTRAINT hipq_rate_count_pkey PRIMARY KEY (queue, rate, part)",
	}, derive: `INSERT INTO hipq_rate_count (queue, rate, part, n)
		SELECT queue, rate, part, sum(n) FROM hipq_rate_unit GROUP BY 1, 2, 3 HAVING sum(n) > 0`},
	{name: "hipq_rate_giveback", kind: citusDistributed},
	{name: "hipq_activity", kind: citusDistributed},
	{name: "hipq_event", kind: citusDistributed, keys: []string{
		"ALTER TABLE hipq_event DROP CONSTRAINT hipq_event_pkey, ADD CONSTRAINT hipq_event_pkey PRIMARY KEY (queue, id)",
	}},
	{name: "hipq_early_reply", kind: citusDistributed, keys: []string{
		// (queue is nullable in the single-node schema: see
		// earlyReplyQueues.)
		"ALTER TABLE hipq_early_reply DROP CONSTRAINT hipq_early_reply_pkey, ADD CONSTRAINT hipq_early_reply_pkey PRIMARY KEY (queue, id)",
	}},
	{name: "hipq_claim_lock", kind: citusDistributed},
	{name: "hipq_queue", kind: citusReference},
	{name: "hipq_schedule", kind: citusReference},
	{name: "hipq_offset", kind: citusLocal},
	{name: "hipq_intake", kind: citusLocal},
	{name: "hipq_dead_letter", kind: citusLocal},
	{name: "hipq_ui_session", kind: citusLocal},
	{name: "hipq_operation", kind: citusLocal},
	{name: "hipq_lock", kind: citusLocal},
	{name: "hipq_event_cursor", kind: citusLocal},
	{name: "hipq_schema_migration", kind: citusLocal},
	{name: "hipq_schema_repeatable", kind: citusLocal},
}

// eventsOffJobs makes of each final event a single-node schema keeps on
// its job (hipq_job.event_id, above its topic's cursor: not relayed yet)
// the row of hipq_event it would be on Citus, with its own id, where the
// relay reads every event: none is lost by the move. Then no job keeps an
// event, and no cursor is kept. Nothing to do once hipq_job is laid out
// for the cluster (no event is kept on a job there).
func eventsOffJobs(ctx context.Context, conn *pgx.Conn) error {
	var known bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = 'hipq_job'::regclass)").Scan(&known); err != nil || known {
		return err
	}
	// (One statement: a move cut short leaves every event where it was.)
	_, err := conn.Exec(ctx, `
		WITH moved AS (
		  INSERT INTO hipq_event (id, queue, topic, job_id, job_type, job_key, attempt, outcome, trace_parent, headers,
		                          state, result, error, job_created_at, finished_at, created_at)
		  OVERRIDING SYSTEM VALUE
		  SELECT j.event_id, j.queue, j.event_topic, j.id, j.job_type, j.job_key, j.attempt, j.outcome, j.trace_parent, j.correlation,
		         j.state, j.result, nullif(j.error, '`+correlator.ErrorNone+`'), j.created_at, j.update_time, j.update_time
		  FROM hipq_job j
		  WHERE j.event_id IS NOT NULL AND `+eventOnJobPending+`
		  ON CONFLICT (id) DO NOTHING
		), off AS (
		  UPDATE hipq_job SET event_id = NULL, event_topic = NULL WHERE event_id IS NOT NULL
		), cursors AS (
		  DELETE FROM hipq_event_cursor
		)
		SELECT 1`)
	return err
}

// citusIndexes are indexes of the layout on Citus only, made at every
// migrate there: the relay's reads of a topic's pending events in the
// order they were written, and of a key's (eventReadCitus).
var citusIndexes = []string{
	"CREATE INDEX IF NOT EXISTS hipq_event_written ON hipq_event (topic, created_at, id)",
	"CREATE INDEX IF NOT EXISTS hipq_event_key ON hipq_event (topic, job_key)",
}

// citusDistributedBy is the distribution column of citusLayout's
// distributed tables, and citusColocateWith the table they are co-located
// with.
const (
	citusDistributedBy = "queue"
	citusColocateWith  = "hipq_job"
)

// ErrNoCitus is returned by Migrate when database.citus is on and the
// database has no citus extension.
var ErrNoCitus = errors.New("database.citus is on, but the citus extension is not in this database: run CREATE EXTENSION citus there (on every node, with its workers added), or set database.citus to auto or off")

// onCitus says whether the schema is laid out for Citus: by the
// configuration, or with CitusAuto when the citus extension is in the
// database.
func (s *Store) onCitus(ctx context.Context, q querier) (bool, error) {
	if s.citus == CitusOff {
		return false, nil
	}
	var has bool
	if err := q.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')").Scan(&has); err != nil {
		return false, fmt.Errorf("look for the citus extension: %w", err)
	}
	if s.citus == CitusOn && !has {
		return false, ErrNoCitus
	}
	return has, nil
}

// citusEnableTriggers lets the migration's session create and distribute
// the trigger of hipq_event (its statement trigger with a transition
// table), which Citus refuses on a distributed table unless told.
const citusEnableTriggers = "SET citus.enable_unsafe_triggers = on"

// distribute lays the migrated schema out for Citus, table by table, each
// in a transaction of its own (its key changes and its distribution
// together, so a failure leaves the table as it was). A table Citus
// already knows is left alone, so distribute runs at every migrate. A
// table with rows is distributed only when moveRows says to (hipq migrate
// --distribute): Citus then copies its rows into the shards, and its local
// copy is emptied in the same transaction; otherwise distribute refuses
// it, saying how to move it. types are the config's job types, which give
// early replies kept without a queue theirs (earlyReplyQueues).
func distribute(ctx context.Context, conn *pgx.Conn, moveRows bool, types correlator.Types) error {
	// hipq_event's trigger would notify from the workers, where nobody
	// listens and whose part of a transaction that also wrote elsewhere
	// (the coordinator's offsets, say) commits in two phases, which
	// refuses NOTIFY: on Citus the statements that write events notify
	// the relay themselves (notifyCitus), and it polls besides. Dropped
	// at every migrate, after the repeatables that may have made it again,
	// and before any table moves (copying hipq_event's rows into its
	// shards would fire it there).
	if _, err := conn.Exec(ctx, "DROP TRIGGER IF EXISTS hipq_event_notify ON hipq_event"); err != nil {
		return fmt.Errorf("citus: drop hipq_event's trigger: %w", err)
	}
	if moveRows {
		// Rate units without a queue cannot take the cluster's key,
		// (queue, id), nor be found by a claim there, which reads its own
		// queue's: they go, and with them the counts they held
		// (hipq_rate_count is derived from the units that stay). Version
		// 23 gave one to every unit but those written before version 17
		// for a job type's rate whose jobs are all gone (pruned, final
		// for longer than the retention); their requests are that old.
		if _, err := conn.Exec(ctx, "DELETE FROM hipq_rate_unit WHERE queue IS NULL"); err != nil {
			return fmt.Errorf("citus: rate units without a queue: %w", err)
		}
		if err := earlyReplyQueues(ctx, conn, types); err != nil {
			return fmt.Errorf("citus: early replies without a queue: %w", err)
		}
		if err := eventsOffJobs(ctx, conn); err != nil {
			return fmt.Errorf("citus: outcome events on jobs: %w", err)
		}
	}
	for _, t := range citusLayout {
		var known bool
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = $1::regclass)", t.name).Scan(&known); err != nil {
			return fmt.Errorf("citus: %s: %w", t.name, err)
		}
		if known {
			continue
		}
		var rows bool
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+pgx.Identifier{t.name}.Sanitize()+")").Scan(&rows); err != nil {
			return fmt.Errorf("citus: %s: %w", t.name, err)
		}
		if t.derive != "" {
			rows = false // (deleted, then derived)
		}
		if rows && !moveRows && t.kind != citusLocal { // (a local table's rows stay where they are)
			return fmt.Errorf("citus: %s is not laid out for the cluster yet and holds rows: stop every hipq, then run hipq migrate --distribute to move them onto the cluster", t.name)
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			for _, k := range t.keys {
				if _, err := tx.Exec(ctx, k); err != nil {
					return fmt.Errorf("%s: %w", k, err)
				}
			}
			var err error
			switch t.kind {
			case citusReference:
				_, err = tx.Exec(ctx, "SELECT create_reference_table($1::regclass)", t.name)
			case citusLocal:
				// (The rows stay where they are: the table is the
				// coordinator's shard of itself.)
				_, err = tx.Exec(ctx, "SELECT citus_add_local_table_to_metadata($1::regclass)", t.name)
				return err
			default:
				_, err = tx.Exec(ctx, "SELECT create_distributed_table($1::regclass, $2, colocate_with => $3)",
					t.name, citusDistributedBy, colocateWith(t.name))
			}
			if err == nil && rows {
				// (Citus copied the rows into the shards; the coordinator's
				// own copy would only take room.)
				_, err = tx.Exec(ctx, "SELECT truncate_local_data_after_distributing_table($1::regclass)", t.name)
			}
			if err == nil && t.derive != "" {
				_, err = tx.Exec(ctx, t.derive)
			}
			return err
		})
		if err != nil {
			return fmt.Errorf("citus: lay out %s as a %s table: %w", t.name, t.kind, err)
		}
	}
	for _, ix := range citusIndexes {
		if _, err := conn.Exec(ctx, ix); err != nil {
			return fmt.Errorf("citus: %s: %w", ix, err)
		}
	}
	return nil
}

// earlyReplyQueues gives the early replies that have no queue yet (kept
// before replies had one, whose job did not exist then: schema version
// 24) the queue their type has in types, before hipq_early_reply moves
// onto the cluster, whose key (queue, id) takes no null. A reply whose type
// types does not name could never match here: it is dead-lettered
// (unknown_job_type), as the sweep would do, never deleted unseen. A table
// already distributed has a queue on every row, and is left alone.
func earlyReplyQueues(ctx context.Context, conn *pgx.Conn, types correlator.Types) error {
	var local bool
	if err := conn.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = 'hipq_early_reply'::regclass)`).Scan(&local); err != nil || !local {
		return err
	}
	names := types.Names()
	queues := make([]string, len(names))
	for i, n := range names {
		queues[i] = types.Get(n).Queue
	}
	return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE hipq_early_reply e SET queue = t.queue FROM unnest($1::text[], $2::text[]) AS t(job_type, queue)
			WHERE e.queue IS NULL AND e.job_type = t.job_type`, names, queues); err != nil {
			return err
		}
		unknown, _, err := earlyLoad(ctx, tx, nil, "", earlyColumns+`WHERE e.queue IS NULL ORDER BY e.id FOR UPDATE`)
		if err != nil || len(unknown) == 0 {
			return err
		}
		dls := make([]DeadLetter, len(unknown))
		for i, in := range unknown {
			why := &correlator.InputError{Code: correlator.CodeUnknownJobType, Detail: fmt.Sprintf("job type %q is not configured", in.Reply.JobType)}
			dls[i] = DeadLetter{Kind: in.Kind, Source: in.Source, Reason: why.Error()}
		}
		if err := deadLettersInsert(ctx, tx, dls); err != nil {
			return err
		}
		return earlyDelete(ctx, tx, unknown)
	})
}

// colocateWith is the colocate_with of create_distributed_table: the first
// distributed table starts a co-location group of its own (not one of the
// database's other tables), the others join it.
func colocateWith(table string) string {
	if table == citusColocateWith {
		return "none"
	}
	return citusColocateWith
}

// laidOutForCitus says whether the store's statements take their
// distributed forms: on Citus (onCitus), unless hipq_job is there and not
// distributed (a schema laid out on one PostgreSQL, before hipq migrate
// --distribute moves it; its tables are local, and its keys the
// single-node ones). A schema not migrated yet is laid out for Citus by
// Migrate, which says so to the store.
func (s *Store) laidOutForCitus(ctx context.Context) (bool, error) {
	citus, err := s.onCitus(ctx, s.pool)
	if errors.Is(err, ErrNoCitus) || !citus {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	var local bool
	err = s.pool.QueryRow(ctx, `SELECT to_regclass('hipq_job') IS NOT NULL
		AND NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = to_regclass('hipq_job'))`).Scan(&local)
	if err != nil {
		return false, fmt.Errorf("look for hipq_job's layout: %w", err)
	}
	return !local, nil
}

// Distributed says whether the store's database is a Citus cluster
// (database.citus on, or auto with the citus extension there).
func (s *Store) Distributed() bool { return s.dist }

// citusTx is a transaction on Citus: the statements that would span
// shards take their distributed forms in it (distributedTx). inTx gives one to
// its function on a Store whose database is a Citus cluster.
type citusTx struct{ pgx.Tx }

// Begin starts a savepoint that is still on Citus.
func (t citusTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := t.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return citusTx{tx}, nil
}

// distributedTx says whether tx runs on a Citus cluster.
func distributedTx(tx pgx.Tx) bool {
	_, ok := tx.(citusTx)
	return ok
}

// statementForms are one statement's four texts: plain or writing outcome
// events, on one PostgreSQL or on Citus (made from the single-node ones).
type statementForms struct{ plain, events, citus, citusEvents string }

func formsOf(plain, events string, forCitus func(string) string) statementForms {
	return statementForms{plain: plain, events: events, citus: forCitus(plain), citusEvents: forCitus(events)}
}

// pick is the text for a statement that writes events or not, on Citus
// or not.
func (f statementForms) pick(events, dist bool) string {
	switch {
	case dist && events:
		return f.citusEvents
	case dist:
		return f.citus
	case events:
		return f.events
	}
	return f.plain
}

// mustReplace replaces the one occurrence of old in s by new, and panics
// (at init, for the statements' texts) when there is none or several: a
// distributed form made from a statement that no longer says old would be
// the single-node form under another name.
func mustReplace(s, old, new string) string {
	if n := strings.Count(s, old); n != 1 {
		panic(fmt.Sprintf("store: %d occurrences of %q in a statement, want 1", n, old))
	}
	return strings.Replace(s, old, new, 1)
}

// replaceEach applies mustReplace to s for each pair of old and new, in
// order.
func replaceEach(s string, oldNew ...string) string {
	for i := 0; i+1 < len(oldNew); i += 2 {
		s = mustReplace(s, oldNew[i], oldNew[i+1])
	}
	return s
}

// notifyCitus tells the dispatchers of queues that they may claim, and
// with events the relay that some were written, in a statement of its own:
// on Citus one that reads no distributed table runs where it was sent, on
// the node the listeners are connected to (a notice from a worker would
// reach nobody, and refuse its transaction's two-phase commit).
func notifyCitus(ctx context.Context, tx execer, events bool, queues ...string) error {
	channels, payloads := make([]string, 0, len(queues)+1), make([]string, 0, len(queues)+1)
	for _, q := range queues {
		channels, payloads = append(channels, channelJobReady), append(payloads, q)
	}
	if events {
		channels, payloads = append(channels, channelEvent), append(payloads, "")
	}
	_, err := tx.Exec(ctx, "SELECT pg_notify(c, p) FROM unnest($1::text[], $2::text[]) AS n(c, p)", channels, payloads)
	return err
}

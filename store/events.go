package store

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/correlator"
)

// Events say which outcome events the statements that end jobs write
// (hipq_event, relayed to Kafka after commit): for each job type with a
// topic, an event when its job ends and, when asked, when an attempt of it
// ends in a retry; and for each job that names its own reply_to, its final
// event there. Without any, those statements are the ones they were before
// events: nothing more is written or sent.
type Events struct {
	// Routes are the job types' events, by type name.
	Routes map[string]correlator.Events
	// ReplyTo: jobs may name their own reply_to topic (some type allows
	// one), which gets their final event.
	ReplyTo bool

	// the routes as the statements' parameters
	types, topics []string
	attempts      []bool

	onJob *onJobCheck
}

// onJobCheck says, once per store, whether its role may leave final events
// on jobs (resolveFinalOnJobSQL): hand out ids from hipq_event's sequence
// itself (an insert into hipq_event needs no privilege on it) and write
// the relay's cursors. A role without them writes rows, as before.
type onJobCheck struct {
	once sync.Once
	ok   bool
}

// onJobSQL is onJobCheck's query (false, not an error, for a relation
// missing).
// (Each privilege on its own: a list is true when any one is held.)
const onJobSQL = `SELECT coalesce(has_sequence_privilege(to_regclass('hipq_event_id_seq')::oid, 'USAGE'), false)
	AND coalesce(has_table_privilege(to_regclass('hipq_event_cursor')::oid, 'SELECT'), false)
	AND coalesce(has_table_privilege(to_regclass('hipq_event_cursor')::oid, 'INSERT'), false)
	AND coalesce(has_table_privilege(to_regclass('hipq_event_cursor')::oid, 'UPDATE'), false)`

// finalOnJob reports whether the store may leave final events on jobs,
// asking through q the first time.
func (e *Events) finalOnJob(ctx context.Context, q querier) bool {
	if e == nil || e.onJob == nil {
		return false
	}
	e.onJob.once.Do(func() {
		if err := q.QueryRow(ctx, onJobSQL).Scan(&e.onJob.ok); err != nil {
			e.onJob.ok = false
		}
	})
	return e.onJob.ok
}

// EventsOf are the events the job types ask for.
func EventsOf(types correlator.Types) Events {
	e := Events{Routes: map[string]correlator.Events{}}
	for name, jt := range types {
		if jt.Events.Topic != "" {
			e.Routes[name] = jt.Events
		}
		e.ReplyTo = e.ReplyTo || len(jt.AllowedReplyTo) > 0
	}
	return e
}

// On reports whether any event is ever written (a nil *Events: none).
func (e *Events) On() bool { return e != nil && (len(e.Routes) > 0 || e.ReplyTo) }

// WithEvents returns a store on the same pool whose statements that end
// jobs write the events e asks for.
func (s *Store) WithEvents(e Events) *Store {
	c := *s
	for _, name := range slices.Sorted(maps.Keys(e.Routes)) {
		r := e.Routes[name]
		e.types, e.topics, e.attempts = append(e.types, name), append(e.topics, r.Topic), append(e.attempts, r.Attempts)
	}
	e.onJob = &onJobCheck{}
	c.events = &e
	return &c
}

// args are the parameters of the routes in a statement built with
// eventsCTE.
func (e *Events) args() (types, topics []string, attempts []bool) {
	if e == nil {
		return nil, nil, nil
	}
	return e.types, e.topics, e.attempts
}

// eventColumns are what eventsCTE reads of each job a statement moved
// (hipq_job j), besides id, queue, job_type and attempt: the row as it is
// after the move.
const eventColumns = `j.job_key, j.state, j.outcome, j.error, j.result, j.created_at, j.update_time, j.trace_parent, j.reply_to, j.correlation`

// eventsCTE is a data-modifying CTE, named ev, that writes the outcome
// events of the jobs in the CTE from (their id, queue, job_type, attempt
// and eventColumns, as the move left them), in the statement that moved
// them: so an event is committed exactly when its job's end is. The routes
// are the parameters types, topics and attempts (unnested together): a
// job of a routed type gets an event on its type's topic when it is final,
// and when its attempt ended in a retry if the route asks for attempts;
// a final job with a reply_to gets one there (once, should it be the
// type's topic too). A row's id is assigned while the statement holds the
// job's row lock, so the events of one job (and of one key: a new job of
// a key exists only once the last is final) are numbered in the order
// they are committed. With finalOnJob the statement marks the final jobs
// of routed types for the relay to read (finalOnJob): their events on
// their type's topic are not written here.
func eventsCTE(from, types, topics, attempts string, finalOnJob bool) string {
	typeCond, rows := `(d.state = 'final' OR r.attempts)`, ""
	if finalOnJob {
		// (what is left for rows: attempts, and reply_to)
		typeCond, rows = `d.state <> 'final' AND r.attempts`, `
		  WHERE d.state <> 'final' OR d.reply_to IS NOT NULL`
	}
	return `ev AS (
		  INSERT INTO hipq_event (queue, topic, job_id, job_type, job_key, attempt, outcome, trace_parent, headers,
		                          state, result, error, job_created_at, finished_at)
		  SELECT d.queue, e.topic, d.id, d.job_type, d.job_key, d.attempt, coalesce(d.outcome, '` + correlator.EventOutcomeRetry + `'),
		         d.trace_parent, d.correlation,
		         d.state, d.result, nullif(d.error, '` + correlator.ErrorNone + `'), d.created_at, d.update_time
		  FROM ` + from + ` d
		  CROSS JOIN LATERAL (
		    SELECT r.topic FROM unnest(` + types + `::text[], ` + topics + `::text[], ` + attempts + `::bool[]) AS r(job_type, topic, attempts)
		    WHERE r.job_type = d.job_type AND ` + typeCond + `
		    UNION ALL
		    SELECT d.reply_to WHERE d.reply_to IS NOT NULL AND d.state = 'final'
		      AND NOT EXISTS (SELECT FROM unnest(` + types + `::text[], ` + topics + `::text[]) AS r(job_type, topic)
		                      WHERE r.job_type = d.job_type AND r.topic = d.reply_to)) e` + rows + `
		  ORDER BY d.id, e.topic
		)`
}

// withEvents makes of a statement that moves jobs in a CTE named done
// (returning their id, queue, job_type and attempt, then the marker
// /*event columns*/, and followed by the marker /*events*/ where a CTE may
// go) the statement that writes their outcome events too, with the routes
// in the parameters types, topics and attempts.
func withEvents(stmt, types, topics, attempts string) string {
	return withEventsCTE(stmt, eventsCTE("done", types, topics, attempts, false))
}

func withEventsCTE(stmt, cte string) string {
	return strings.NewReplacer(
		"/*event columns*/", ", "+eventColumns,
		"/*events*/", cte+", ",
	).Replace(stmt)
}

// correlationJSON encodes a job's correlation headers as hipq_job.correlation
// keeps them (the format of headersJSON, nothing dropped: the producer
// chose to have them copied back); nil when there are none.
func correlationJSON(hs []correlator.Header) *string {
	if len(hs) == 0 {
		return nil
	}
	out := make([]headerJSON, len(hs))
	for i, h := range hs {
		out[i] = headerJSON{Key: h.Key, Value: base64.StdEncoding.EncodeToString(h.Value)}
		if strings.IndexByte(h.Key, 0) >= 0 || !json.Valid([]byte(`"`+h.Key+`"`)) {
			out[i].Key, out[i].KeyBase64 = "", base64.StdEncoding.EncodeToString([]byte(h.Key))
		}
	}
	b, _ := json.Marshal(out)
	s := string(b)
	return &s
}

// Event is one outcome event waiting in hipq_event to be relayed.
type Event struct {
	ID          int64 // its hipq-event-id
	Queue       string
	Topic       string
	JobID       int64
	JobType     string
	JobKey      string
	Attempt     int
	Outcome     string
	TraceParent string
	Headers     []correlator.Header // the job's hipq-correlation-* headers
	Value       json.RawMessage
	CreatedAt   time.Time
	// OnJob: the event is its job's final event read from the job
	// (hipq_job.event_id), not a row of hipq_event.
	OnJob bool
}

// jobEventTopicsCTE is a recursive CTE, named jt, of the topics of the
// jobs whose final events are read from them: a skip scan of
// hipq_job_event, one probe per topic (a topic null ends it).
const jobEventTopicsCTE = `jt AS (
		  (SELECT event_topic AS topic FROM hipq_job WHERE event_id IS NOT NULL ORDER BY event_topic LIMIT 1)
		  UNION ALL
		  SELECT (SELECT j.event_topic FROM hipq_job j WHERE j.event_id IS NOT NULL AND j.event_topic > jt.topic ORDER BY j.event_topic LIMIT 1)
		  FROM jt WHERE jt.topic IS NOT NULL
		)`

// eventOnJobPending is true of a job j whose final event is read from it
// and not relayed yet: above its topic's cursor.
const eventOnJobPending = `j.event_id > coalesce((SELECT c.after FROM hipq_event_cursor c WHERE c.topic = j.event_topic), 0)`

// EventTopics lists the topics with events pending, in name order: a skip
// scan of hipq_event_topic, one probe per topic however many wait; and
// those of the jobs whose final events are read from them (hipq_job_event),
// which the relay reads from their cursors.
func (s *Store) EventTopics(ctx context.Context) ([]string, error) {
	q := `
		WITH RECURSIVE t AS (
		  (SELECT topic FROM hipq_event ORDER BY topic LIMIT 1)
		  UNION ALL
		  SELECT (SELECT e.topic FROM hipq_event e WHERE e.topic > t.topic ORDER BY e.topic LIMIT 1)
		  FROM t WHERE t.topic IS NOT NULL
		), ` + jobEventTopicsCTE + `
		SELECT topic FROM t WHERE topic IS NOT NULL
		UNION SELECT topic FROM jt WHERE topic IS NOT NULL
		ORDER BY 1`
	if s.dist {
		// (Citus plans a recursive CTE only within one shard: each shard
		// lists its own topics, from its events' topic index.)
		q = `SELECT DISTINCT topic FROM hipq_event ORDER BY 1`
	}
	rows, err := s.pool.Query(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("list topics with events: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list topics with events: %w", err)
	}
	return out, nil
}

// eventReadColumns are what EventRead reads of an event, in scanEvents'
// order.
const eventReadColumns = `id, queue, topic, job_id, job_type, job_key, attempt, outcome, coalesce(trace_parent, ''), headers, value, created_at,
	coalesce(state, ''), result, error, coalesce(job_created_at, created_at), coalesce(finished_at, created_at), false`

// eventJobColumns are eventReadColumns of a job's final event read from
// the job (hipq_job j), as eventsCTE would have written its row.
const eventJobColumns = `j.event_id, j.queue, j.event_topic, j.id, j.job_type, j.job_key, j.attempt, j.outcome, coalesce(j.trace_parent, ''),
	j.correlation, NULL::jsonb, j.update_time, j.state, j.result, nullif(j.error, '` + correlator.ErrorNone + `'), j.created_at, j.update_time, true`

// EventRead returns up to limit of topic's pending events, in id order:
// for each job key, the order its events were committed in. On Citus ids
// are not in that order when instances on several nodes wrote them (each
// node's sequence hands out a range of its own): there each event read in
// id order stands for its key's first pending event (eventReadCitus).
func (s *Store) EventRead(ctx context.Context, topic string, limit int) ([]Event, error) {
	return s.EventReadFrom(ctx, topic, nil, limit)
}

// eventPlanSettings make the relay's reads and deletes of hipq_event go
// by its indexes, in their order.
const eventPlanSettings = `SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true),
	set_config('enable_sort', 'off', true)`

// indexedBatch is a batch that opens a transaction with begin and
// eventPlanSettings: the caller queues its statements, then COMMIT.
func indexedBatch(begin string) *pgx.Batch {
	b := &pgx.Batch{}
	b.Queue(begin)
	b.Queue(eventPlanSettings)
	return b
}

// EventCursor is where a relay's reads of one topic start: above the
// events it relayed, so that a read does not walk the index entries of
// the rows it deleted (they stay until vacuum, and a read from the
// topic's first id passes each of them). The zero value reads from the
// first id.
//
// An id is handed out before its transaction commits, so an event may
// become visible after one of a higher id was read and deleted: a cursor
// never passes an id that may still be committed. It passes an id only
// once it is settled, known to be visible to the reads if it ever
// commits. The delete that follows a read notes the highest id that read
// saw, with the delete's own transaction id: every transaction holding an
// id up to the one noted took its transaction id before that id (every
// statement that writes an event has moved its job first, and ids are
// handed out in order, CACHE 1), so before the read, so below the
// delete's. Once a later read's snapshot has an xmin at or above it,
// every such transaction has ended, and what it committed is visible to
// that read. (A snapshot's xmax would not do: it is one past the highest
// transaction id ended, and a transaction still open may hold one at or
// above it without being in the snapshot's list.)
type EventCursor struct {
	after   int64 // reads start above this id: every event up to it was relayed, or never will be
	settled int64 // the ids up to this one are visible to the reads, if they ever commit
	// a pending mark: ids up to upTo are settled once a read's xmin
	// reaches xid (none when xid is 0)
	upTo, xid int64
	last      int64 // the last read's highest id
	full      bool  // the last read returned its limit: more may wait above last
	used      bool  // the last read was in id order (not Citus's)

	// Of a topic whose final events are read from the jobs (Event.OnJob),
	// which the relay does not delete: how far it relayed is written to
	// hipq_event_cursor with its deletes, and read back by the next relay.
	//
	// The cursor passes an id only once it is settled, and a transaction
	// open anywhere in the cluster holds every snapshot's xmin back (a long
	// report, a dump): the events read from jobs and sent meanwhile are
	// remembered (sent), up to maxSent; beyond, those sent are struck from
	// their jobs (event_id cleared, guarded by its value) with the delete,
	// as rows of hipq_event are deleted.
	topic   string
	kept    bool             // after is kept in hipq_event_cursor (a row exists, or the topic had events read from jobs)
	saved   int64            // the value last written there
	sent    map[int64]jobRef // the events read from jobs, above after, sent already: the reads skip them
	maxSent int              // how many sent may be remembered (0: eventSentMax)
	// the highest id of an event read from a job and sent, by job key,
	// while above saved (Holds); and the keys Holds held back since the
	// last delete, whose sent events that delete strikes
	sentKeys map[string]int64
	held     map[string]bool
}

// eventSentMax is how many events read from jobs and sent a cursor
// remembers above its after (see EventCursor).
const eventSentMax = 20000

// jobRef names a job.
type jobRef struct {
	queue string
	id    int64
	key   string
}

// Holds reports whether key's events must wait: an event of key read
// from its job was sent above the cursor kept in hipq_event_cursor, which
// a relay after a crash starts from and sends again, so a key's later
// event would reach the topic before that event's second copy.
func (c *EventCursor) Holds(key string) bool {
	if c == nil {
		return false
	}
	id, ok := c.sentKeys[key]
	if !ok || id <= c.saved {
		return false
	}
	// (The next delete strikes the key's sent events from their jobs,
	// which then are never sent again: the key waits one batch, not until
	// the cursor kept passes them, which a transaction open long anywhere
	// in the cluster can hold back.)
	if c.held == nil {
		c.held = map[string]bool{}
	}
	c.held[key] = true
	return true
}

// savedAt notes that hipq_event_cursor keeps the cursor at saved.
func (c *EventCursor) savedAt(saved int64) {
	if saved <= c.saved {
		return
	}
	c.saved = saved
	for k, id := range c.sentKeys {
		if id <= saved {
			delete(c.sentKeys, k)
		}
	}
}

// EventCursorOf is the cursor from which a relay starts reading topic:
// after the events it relayed, as hipq_event_cursor keeps it; from the
// first id when it keeps none (and on Citus, which reads otherwise).
func (s *Store) EventCursorOf(ctx context.Context, topic string) (*EventCursor, error) {
	c := &EventCursor{topic: topic}
	if s.dist {
		return c, nil
	}
	err := s.pool.QueryRow(ctx, `SELECT after FROM hipq_event_cursor WHERE topic = $1`, topic).Scan(&c.after)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return c, nil
	case err != nil:
		return nil, fmt.Errorf("read the events' cursor of %s: %w", topic, err)
	}
	c.kept, c.saved = true, c.after
	return c, nil
}

// sentIDs are the events read from jobs, above after, sent already: the
// reads skip them.
func (c *EventCursor) sentIDs() []int64 {
	if c == nil || len(c.sent) == 0 {
		return []int64{}
	}
	out := make([]int64, 0, len(c.sent))
	for id := range c.sent {
		out = append(out, id)
	}
	return out
}

// Sent notes events sent (the broker acknowledged them): those read from
// jobs are skipped by the reads until the cursor passes them.
func (c *EventCursor) Sent(refs []EventRef) {
	if c == nil {
		return
	}
	for _, r := range refs {
		if r.OnJob && r.ID > c.after {
			if c.sent == nil {
				c.sent, c.sentKeys = map[int64]jobRef{}, map[string]int64{}
			}
			c.sent[r.ID] = jobRef{r.Queue, r.JobID, r.JobKey}
			c.sentKeys[r.JobKey] = max(c.sentKeys[r.JobKey], r.ID)
		}
	}
}

// toStrike returns the events read from jobs and sent that are to be
// struck from their jobs: those that stay remembered above after once it
// is at upTo, when they are more than the cursor may remember, and those
// of the keys Holds held back.
func (c *EventCursor) toStrike(upTo int64) map[int64]jobRef {
	n := 0
	for id := range c.sent {
		if id > upTo {
			n++
		}
	}
	all := n > cmp.Or(c.maxSent, eventSentMax)
	if !all && len(c.held) == 0 {
		return nil
	}
	out := map[int64]jobRef{}
	for id, j := range c.sent {
		if all && id > upTo || c.held[j.key] {
			out[id] = j
		}
	}
	return out
}

// struck notes that the events struck were struck from their jobs.
func (c *EventCursor) struck(struck map[int64]jobRef) {
	for id, j := range struck {
		delete(c.sent, id)
		if c.sentKeys[j.key] == id {
			delete(c.sentKeys, j.key)
		}
	}
	clear(c.held)
}

// eventStrikeSQL clears the event_id of the jobs of queue $1 whose ids
// are $2, each guarded by its event id ($3) and state final: their events
// were sent, and are read no more.
const eventStrikeSQL = `
	UPDATE hipq_job j SET event_id = NULL
	FROM unnest($2::bigint[], $3::bigint[]) AS u(id, event_id)
	WHERE j.queue = $1 AND j.id = u.id AND j.event_id = u.event_id AND j.state = 'final'`

// passes is where Passed(lowest) would move after to.
func (c *EventCursor) passes(lowest int64) int64 {
	upTo := c.settled
	switch {
	case lowest > 0:
		upTo = min(upTo, lowest-1)
	case c.full:
		upTo = min(upTo, c.last)
	}
	return max(c.after, upTo)
}

// After is the id above which the cursor's reads start.
func (c *EventCursor) After() int64 { return c.after }

// Passed moves the cursor after a batch was relayed and deleted
// (EventDeleteFrom): lowest is the lowest id the last read returned whose
// event is still pending (skipped or not acknowledged; 0 when every event
// it returned was deleted). It passes only settled ids, and none still
// pending.
func (c *EventCursor) Passed(lowest int64) {
	if c == nil || !c.used {
		return
	}
	c.after = c.passes(lowest)
	for id := range c.sent {
		if id <= c.after {
			delete(c.sent, id)
		}
	}
}

// read notes a read in id order that returned events: its snapshot's
// xmin, and the highest id it returned.
func (c *EventCursor) read(xmin, highest int64, full bool) {
	c.used, c.full, c.last = true, full, highest
	c.settle(xmin)
}

// settle notes a read's snapshot xmin: the pending mark is settled once
// it reaches the mark's transaction id.
func (c *EventCursor) settle(xmin int64) {
	if c.xid != 0 && xmin >= c.xid {
		c.settled, c.xid = max(c.settled, c.upTo), 0
	}
}

// readNone notes a read in id order that found no event pending: every
// settled id is passed (none above after is pending), so an idle relay's
// cursor reaches the last event it relayed. It reports whether a
// transaction is to follow (eventsDone with no event): to write the cursor
// to hipq_event_cursor, or to give it a mark (a transaction id handed out
// after the last read).
func (c *EventCursor) readNone(xmin int64) bool {
	if !c.used {
		return false
	}
	c.settle(xmin)
	c.full = false
	c.Passed(0)
	return c.kept && c.after > c.saved || c.xid == 0 && c.last > c.settled
}

// deleted notes the delete that followed the last read, by the
// transaction xid.
func (c *EventCursor) deleted(xid int64) {
	if c.used && c.xid == 0 && c.last > c.settled {
		c.upTo, c.xid = c.last, xid
	}
}

// EventReadFrom is EventRead from the cursor c (nil: from the first id),
// which it notes the read in; on Citus c is not used (eventReadCitus).
func (s *Store) EventReadFrom(ctx context.Context, topic string, c *EventCursor, limit int) ([]Event, error) {
	if s.dist {
		return s.eventReadCitus(ctx, topic, limit)
	}
	var after int64
	if c != nil {
		after = c.after
	}
	// The read is an ordered scan of hipq_event_topic from the cursor,
	// whatever the statistics say: on a table the planner takes for small
	// it reads the heap, or the index's whole range of the topic, into a
	// sort, and either walks every row deleted since the last vacuum. The
	// xmin noted is that of the snapshot that read the rows (one
	// statement).
	// The jobs whose final event is read from them (event_id set) are
	// merged in, in the same order (one sequence numbers both), but for
	// those sent already (the cursor's sent).
	// (One snapshot for the transaction: a read that finds none notes
	// its snapshot's xmin too, from a statement of its own.)
	var out []Event
	var xmin, noneXmin int64
	b := indexedBatch("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
	b.Queue(`
		WITH s AS MATERIALIZED (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin)
		SELECT s.xmin, e.* FROM s CROSS JOIN LATERAL (
		  (SELECT `+eventReadColumns+` FROM hipq_event WHERE topic = $1 AND id > $2 ORDER BY id LIMIT $3)
		  UNION ALL
		  (SELECT `+eventJobColumns+` FROM hipq_job j
		   WHERE j.event_topic = $1 AND j.event_id > $2 AND j.event_id IS NOT NULL
		     AND j.event_id NOT IN (SELECT unnest($4::bigint[])) -- (a hashed subplan: one lookup a row)
		   ORDER BY j.event_id LIMIT $3)
		  ORDER BY 1 LIMIT $3) e`,
		topic, after, limit, c.sentIDs()).Query(func(rows pgx.Rows) error {
		var err error
		out, err = scanEventsWith(rows, topic, &xmin)
		return err
	})
	b.Queue(`SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint`).QueryRow(func(r pgx.Row) error { return r.Scan(&noneXmin) })
	b.Queue("COMMIT")
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("read events of %s: %w", topic, err)
	}
	if c != nil && len(out) > 0 {
		c.read(xmin, out[len(out)-1].ID, len(out) == limit)
		for _, e := range out {
			c.kept = c.kept || e.OnJob
		}
	}
	if c != nil && len(out) == 0 && c.readNone(noneXmin) {
		// (a relay that has caught up passes, at its next look, what it
		// sent last)
		if err := s.eventsDone(ctx, c, nil, 0); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// eventCursorSaveSQL writes how far topic $1 was relayed ($2): never
// back (two relays, one losing its lease, may both write).
const eventCursorSaveSQL = `
	INSERT INTO hipq_event_cursor AS c (topic, after) VALUES ($1, $2)
	ON CONFLICT (topic) DO UPDATE SET after = greatest(c.after, excluded.after), update_time = now()`

// eventReadCitus is EventRead on Citus. It reads up to limit events in the
// order they were written (their transactions' start, then id: ids alone
// would read the coordinator's first, a worker's range lying above it),
// then puts in place of each its key's first pending event in the order
// the key's events happened: each job's events by attempt (one event per
// attempt and topic, written under the job's row lock), and a key's jobs
// by when their first pending event ended an attempt (a key's next job is
// made once the last one is final, and its attempts end after its
// requests left: after that final event). So a key's event never leaves
// before one that happened earlier, whichever node numbered them; the
// relay takes each key's first event once and reads the rest at its next
// look.
func (s *Store) eventReadCitus(ctx context.Context, topic string, limit int) ([]Event, error) {
	rows, err := s.pool.Query(ctx, `SELECT job_key FROM hipq_event WHERE topic = $1 ORDER BY created_at, id LIMIT $2`, topic, limit)
	if err != nil {
		return nil, fmt.Errorf("read events of %s: %w", topic, err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(keys) == 0 {
		if err != nil {
			err = fmt.Errorf("read events of %s: %w", topic, err)
		}
		return nil, err
	}
	rows, err = s.pool.Query(ctx, `SELECT DISTINCT ON (job_key) `+eventReadColumns+` FROM (
		  SELECT *, min(coalesce(finished_at, (value->>'finished_at')::timestamptz)) OVER (PARTITION BY queue, job_id) AS job_ended
		  FROM hipq_event WHERE topic = $1 AND job_key = ANY($2)) e
		ORDER BY job_key, job_ended, job_id, attempt, id`, topic, slices.Compact(slices.Sorted(slices.Values(keys))))
	if err != nil {
		return nil, fmt.Errorf("read events of %s: %w", topic, err)
	}
	firsts, err := scanEvents(rows, topic)
	if err != nil {
		return nil, err
	}
	first := make(map[string]Event, len(firsts))
	for _, e := range firsts {
		first[e.JobKey] = e
	}
	out := make([]Event, 0, len(keys))
	for _, k := range keys {
		if e, ok := first[k]; ok { // (a key whose events were deleted between the reads has none)
			out = append(out, e)
		}
	}
	return out, nil
}

// scanEvents reads the events rows holds (eventReadColumns).
func scanEvents(rows pgx.Rows, topic string) ([]Event, error) {
	return scanEventsWith(rows, topic)
}

// scanEventsWith reads the events rows holds (eventReadColumns, after the
// columns lead are scanned into).
func scanEventsWith(rows pgx.Rows, topic string, lead ...any) ([]Event, error) {
	var out []Event
	var e Event
	var headers, value []byte // (bytes: pgx copies them, where a json.RawMessage is decoded and encoded again)
	var v eventValue
	var result []byte
	_, err := pgx.ForEachRow(rows, append(lead, &e.ID, &e.Queue, &e.Topic, &e.JobID, &e.JobType, &e.JobKey, &e.Attempt, &e.Outcome,
		&e.TraceParent, &headers, &value, &e.CreatedAt, &v.State, &result, &v.Error, &v.CreatedAt, &v.FinishedAt, &e.OnJob), func() error {
		ev := e
		if value != nil { // (written by a version before 26, with its value)
			ev.Value = append(json.RawMessage(nil), value...)
		} else {
			v.JobType, v.JobKey, v.JobID, v.Attempt, v.Outcome = e.JobType, e.JobKey, e.JobID, e.Attempt, e.Outcome
			v.Result = result
			ev.Value = v.appendJSON(make([]byte, 0, 256+len(v.JobType)+len(v.JobKey)+len(result)))
		}
		ev.Headers = nil
		if headers != nil {
			ev.Headers = decodeHeaders(headers)
		}
		out = append(out, ev)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read events of %s: %w", topic, err)
	}
	return out, nil
}

// eventValue is an event's value (docs/messages.md, "Outcome events";
// schemas/json/event.schema.json).
type eventValue struct {
	JobType, JobKey       string
	JobID                 int64
	Attempt               int
	State, Outcome        string
	Result                []byte  // JSON (jsonb's text); nil: null
	Error                 *string // nil: null
	CreatedAt, FinishedAt time.Time
}

// appendJSON appends v as a JSON object, its fields in the order
// documented, its times in RFC 3339 in UTC. (Written out, not through
// encoding/json: it is the relay's work for every event, and reflection
// cost more than the rest of the relay's reading.)
func (v *eventValue) appendJSON(b []byte) []byte {
	b = append(b, `{"job_type":`...)
	b = appendJSONString(b, v.JobType)
	b = append(b, `,"job_key":`...)
	b = appendJSONString(b, v.JobKey)
	b = append(b, `,"job_id":`...)
	b = strconv.AppendInt(b, v.JobID, 10)
	b = append(b, `,"attempt":`...)
	b = strconv.AppendInt(b, int64(v.Attempt), 10)
	b = append(b, `,"state":`...)
	b = appendJSONString(b, v.State)
	b = append(b, `,"outcome":`...)
	b = appendJSONString(b, v.Outcome)
	b = append(b, `,"result":`...)
	if v.Result == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, v.Result...)
	}
	b = append(b, `,"error":`...)
	if v.Error == nil {
		b = append(b, "null"...)
	} else {
		b = appendJSONString(b, *v.Error)
	}
	b = append(b, `,"created_at":"`...)
	b = v.CreatedAt.UTC().AppendFormat(b, time.RFC3339Nano)
	b = append(b, `","finished_at":"`...)
	b = v.FinishedAt.UTC().AppendFormat(b, time.RFC3339Nano)
	return append(b, `"}`...)
}

// appendJSONString appends s as a JSON string: quotes, backslashes and
// control characters escaped, as are U+2028 and U+2029 (which JavaScript
// takes for line ends), and invalid UTF-8 replaced by U+FFFD, as
// encoding/json writes them (but for its HTML escapes, which JSON does not
// need).
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// EventRef names one event: its queue, topic and id, and whether it was
// read from its job, JobID (no row of hipq_event holds it).
type EventRef struct {
	Queue, Topic string
	ID           int64
	OnJob        bool
	JobID        int64
	JobKey       string
}

// Ref names e.
func (e *Event) Ref() EventRef {
	return EventRef{Queue: e.Queue, Topic: e.Topic, ID: e.ID, OnJob: e.OnJob, JobID: e.JobID, JobKey: e.JobKey}
}

// eventDeleteSQL deletes relayed events of one queue ($1) and topic ($2)
// by id ($3). Each id is looked up on its own, in a subquery the planner
// cannot flatten (OFFSET 0), by equality on every column of either index
// of the table (the primary key, hipq_event_topic: on Citus (queue, id)
// and the topic's), so whichever index the planner takes, the lookup is a
// probe; the rows found are then deleted by their tuple ids (a TID scan).
// Rows of hipq_event are never updated, so a version found is the one to
// delete. A delete by the list itself (id = ANY) lets the planner, on
// statistics that say the table is empty, as they do once the relay has
// caught up, take hipq_event_topic and scan it: for every id of the batch
// (by id alone), or the topic's whole range once, comparing each row with
// the list (with the topic named). Either walks the rows relayed before,
// dead until vacuum: a delete costing the table, not the batch, and a
// relay that falls behind. (The queue is $1, as in markSentSQL.)
const eventDeleteSQL = `
	DELETE FROM hipq_event e
	WHERE e.queue = $1 AND e.ctid = ANY (ARRAY(
	  SELECT x.ctid FROM unnest($3::bigint[]) AS u(id)
	  CROSS JOIN LATERAL (SELECT f.ctid FROM hipq_event f
	                      WHERE f.queue = $1 AND f.topic = $2 AND f.id = u.id
	                      OFFSET 0) x))`

// EventDelete deletes relayed events (the broker acknowledged them): one
// statement (eventDeleteSQL) per queue and topic, so that on Citus each
// deletes on its queue's shard only.
func (s *Store) EventDelete(ctx context.Context, refs []EventRef) error {
	return s.EventDeleteFrom(ctx, nil, refs, 0)
}

// EventDeleteFrom is EventDelete of events read from the cursor c, which
// it notes the delete in and then passes (Passed(lowest): lowest is the
// lowest id of the last read still pending, 0 when none is); c may be nil.
// Events read from their jobs have no row to delete: the cursor, when its
// topic has such events, is written to hipq_event_cursor in the same
// transaction.
func (s *Store) EventDeleteFrom(ctx context.Context, c *EventCursor, refs []EventRef, lowest int64) error {
	if len(refs) == 0 && (c == nil || len(c.held) == 0) {
		c.Passed(lowest) // (none sent: the cursor still passes what is settled below the lowest pending)
		return nil
	}
	return s.eventsDone(ctx, c, refs, lowest)
}

// eventsDone is EventDeleteFrom's transaction: the rows of refs deleted,
// the cursor c written to hipq_event_cursor when its topic keeps it there
// and it moved, the sent events struck from their jobs that it must
// strike, and c given the transaction's id as its mark.
func (s *Store) eventsDone(ctx context.Context, c *EventCursor, refs []EventRef, lowest int64) error {
	c.Sent(refs)
	type group struct{ queue, topic string }
	byRows := map[group][]int64{}
	for _, r := range refs {
		if r.OnJob {
			continue
		}
		k := group{r.Queue, r.Topic}
		byRows[k] = append(byRows[k], r.ID)
	}
	keys := slices.SortedFunc(maps.Keys(byRows), func(a, b group) int {
		return cmp.Or(strings.Compare(a.queue, b.queue), strings.Compare(a.topic, b.topic))
	})
	// On one PostgreSQL: in a transaction of its own, by the indexes
	// whatever the statistics say (see EventReadFrom), whose id the cursor
	// notes. On Citus each statement names its queue, so each deletes on
	// that queue's shard only.
	b := &pgx.Batch{}
	if !s.dist {
		b = indexedBatch("BEGIN")
	}
	for _, k := range keys {
		b.Queue(eventDeleteSQL, k.queue, k.topic, byRows[k])
	}
	var xid, save int64
	var struck map[int64]jobRef
	if c != nil && c.kept && !s.dist && c.used {
		if save = c.passes(lowest); save > c.saved {
			b.Queue(eventCursorSaveSQL, c.topic, save)
		}
		if struck = c.toStrike(save); len(struck) > 0 {
			byQueue := map[string][2][]int64{}
			for id, j := range struck {
				q := byQueue[j.queue]
				byQueue[j.queue] = [2][]int64{append(q[0], j.id), append(q[1], id)}
			}
			for _, q := range slices.Sorted(maps.Keys(byQueue)) {
				b.Queue(eventStrikeSQL, q, byQueue[q][0], byQueue[q][1])
			}
		}
	}
	if !s.dist {
		b.Queue(`SELECT pg_current_xact_id()::text::bigint`).QueryRow(func(r pgx.Row) error { return r.Scan(&xid) })
		b.Queue("COMMIT")
	}
	err := s.pool.SendBatch(ctx, b).Close()
	if err != nil {
		return fmt.Errorf("delete relayed events: %w", err)
	}
	if c != nil && !s.dist {
		c.savedAt(save)
		c.struck(struck)
		c.deleted(xid)
		c.Passed(lowest)
	}
	return nil
}

// EventsPending counts the pending events of each topic that has some.
func (s *Store) EventsPending(ctx context.Context) (map[string]int64, error) {
	q := `SELECT topic, count(*) FROM hipq_event GROUP BY topic`
	if !s.dist {
		// (and the jobs' final events above their topic's cursor, one
		// range of hipq_job_event per topic)
		q = `
		WITH RECURSIVE ` + jobEventTopicsCTE + `
		SELECT topic, sum(n)::bigint FROM (
		  SELECT topic, count(*) AS n FROM hipq_event GROUP BY topic
		  UNION ALL
		  SELECT jt.topic, (SELECT count(*) FROM hipq_job j WHERE j.event_topic = jt.topic AND j.event_id IS NOT NULL
		                    AND ` + eventOnJobPending + `)
		  FROM jt WHERE jt.topic IS NOT NULL
		) p GROUP BY topic HAVING sum(n) > 0`
	}
	rows, err := s.pool.Query(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("count pending events: %w", err)
	}
	out := map[string]int64{}
	var t string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&t, &n}, func() error { out[t] = n; return nil }); err != nil {
		return nil, fmt.Errorf("count pending events: %w", err)
	}
	return out, nil
}

// relayLockKey is the advisory lock key held by the one instance relaying
// the events of hipq's schema, so no two relay a topic at once (each
// topic's events leave in order); the key names the schema, so the hipq
// of another schema in the same database relays its own.
const relayLockKey = `hashtextextended('hipq_event_relay/' || current_schema(), 0)`

// Lease is a session lock held on a connection of its own.
type Lease struct {
	alive   func(context.Context) error
	release func()
}

// Alive checks the lock is still held: its connection answers (a lost
// connection lost its lock with it).
func (l *Lease) Alive(ctx context.Context) error { return l.alive(ctx) }

// Release gives the lock up and its connection back.
func (l *Lease) Release() { l.release() }

// EventRelayLock tries to take the relay's lock. When ok, the lease must
// be released.
func (s *Store) EventRelayLock(ctx context.Context) (*Lease, bool, error) {
	return s.sessionLock(ctx, relayLockKey, "relay", "relay lock")
}

// sessionLock tries to take the session advisory lock key (SQL) on a
// connection of its own, held until the lease is released; what names the
// lock in errors. On Citus, where that lock holds on the node it was taken
// on only, it also takes the lease named lease of hipq_lock (leaseLock),
// which every node sees; the advisory lock still excludes the instances
// that take only it.
func (s *Store) sessionLock(ctx context.Context, key, lease, what string) (*Lease, bool, error) {
	l, ok, err := s.advisoryLock(ctx, key, what)
	if !ok || !s.dist {
		return l, ok, err
	}
	cl, ok, err := s.leaseLock(ctx, lease, what)
	if !ok {
		l.Release()
		return nil, false, err
	}
	return &Lease{
		alive: func(ctx context.Context) error { return errors.Join(l.Alive(ctx), cl.Alive(ctx)) },
		release: func() {
			cl.Release()
			l.Release()
		},
	}, true, nil
}

// advisoryLock is sessionLock's advisory lock.
func (s *Store) advisoryLock(ctx context.Context, key, what string) (*Lease, bool, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("%s: %w", what, err)
	}
	var ok bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock("+key+")").Scan(&ok); err != nil || !ok {
		conn.Release()
		if err != nil {
			return nil, false, fmt.Errorf("%s: %w", what, err)
		}
		return nil, false, nil
	}
	return &Lease{
		alive: func(ctx context.Context) error {
			if _, err := conn.Exec(ctx, "SELECT 1"); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
			return nil
		},
		release: func() {
			if _, err := conn.Exec(context.Background(), "SELECT pg_advisory_unlock("+key+")"); err != nil {
				// A connection whose unlock failed must not go back to the pool holding the lock.
				_ = conn.Conn().Close(context.Background())
			}
			conn.Release()
		},
	}, true, nil
}

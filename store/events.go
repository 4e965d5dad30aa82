package store

import (
	"context"
	"encoding/base64"
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
// they are committed.
func eventsCTE(from, types, topics, attempts string) string {
	return `ev AS (
		  INSERT INTO hipq_event (queue, topic, job_id, job_type, job_key, attempt, outcome, trace_parent, headers, value)
		  SELECT d.queue, e.topic, d.id, d.job_type, d.job_key, d.attempt, coalesce(d.outcome, '` + correlator.EventOutcomeRetry + `'),
		         d.trace_parent, d.correlation,
		         jsonb_build_object('job_type', d.job_type, 'job_key', d.job_key, 'job_id', d.id, 'attempt', d.attempt,
		                            'state', d.state, 'outcome', coalesce(d.outcome, '` + correlator.EventOutcomeRetry + `'),
		                            'result', d.result, 'error', nullif(d.error, '` + correlator.ErrorNone + `'),
		                            'created_at', d.created_at, 'finished_at', d.update_time)
		  FROM ` + from + ` d
		  CROSS JOIN LATERAL (
		    SELECT r.topic FROM unnest(` + types + `::text[], ` + topics + `::text[], ` + attempts + `::bool[]) AS r(job_type, topic, attempts)
		    WHERE r.job_type = d.job_type AND (d.state = 'final' OR r.attempts)
		    UNION
		    SELECT d.reply_to WHERE d.reply_to IS NOT NULL AND d.state = 'final') e
		  ORDER BY d.id, e.topic
		)`
}

// withEvents makes of a statement that moves jobs in a CTE named done
// (returning their id, queue, job_type and attempt, then the marker
// /*event columns*/, and followed by the marker /*events*/ where a CTE may
// go) the statement that writes their outcome events too, with the routes
// in the parameters types, topics and attempts.
func withEvents(stmt, types, topics, attempts string) string {
	return strings.NewReplacer(
		"/*event columns*/", ", "+eventColumns,
		"/*events*/", eventsCTE("done", types, topics, attempts)+", ",
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
}

// EventTopics lists the topics with events pending, in name order: a skip
// scan of hipq_event_topic, one probe per topic however many wait.
func (s *Store) EventTopics(ctx context.Context) ([]string, error) {
	q := `
		WITH RECURSIVE t AS (
		  (SELECT topic FROM hipq_event ORDER BY topic LIMIT 1)
		  UNION ALL
		  SELECT (SELECT e.topic FROM hipq_event e WHERE e.topic > t.topic ORDER BY e.topic LIMIT 1)
		  FROM t WHERE t.topic IS NOT NULL
		)
		SELECT topic FROM t WHERE topic IS NOT NULL`
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
const eventReadColumns = `id, queue, topic, job_id, job_type, job_key, attempt, outcome, coalesce(trace_parent, ''), headers, value, created_at`

// EventRead returns up to limit of topic's pending events, in id order:
// for each job key, the order its events were committed in. On Citus ids
// are not in that order when instances on several nodes wrote them (each
// node's sequence hands out a range of its own): there each event read in
// id order stands for its key's first pending event (eventReadCitus).
func (s *Store) EventRead(ctx context.Context, topic string, limit int) ([]Event, error) {
	if s.dist {
		return s.eventReadCitus(ctx, topic, limit)
	}
	rows, err := s.pool.Query(ctx, `SELECT `+eventReadColumns+` FROM hipq_event WHERE topic = $1 ORDER BY id LIMIT $2`, topic, limit)
	if err != nil {
		return nil, fmt.Errorf("read events of %s: %w", topic, err)
	}
	return scanEvents(rows, topic)
}

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
		  SELECT *, min((value->>'finished_at')::timestamptz) OVER (PARTITION BY queue, job_id) AS job_ended
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
	var out []Event
	var e Event
	var headers, value []byte // (bytes: pgx copies them, where a json.RawMessage is decoded and encoded again)
	_, err := pgx.ForEachRow(rows, []any{&e.ID, &e.Queue, &e.Topic, &e.JobID, &e.JobType, &e.JobKey, &e.Attempt, &e.Outcome,
		&e.TraceParent, &headers, &value, &e.CreatedAt}, func() error {
		ev := e
		ev.Value = append(json.RawMessage(nil), value...)
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

// EventRef names one event row: its queue and id.
type EventRef struct {
	Queue string
	ID    int64
}

// Ref names e's row.
func (e *Event) Ref() EventRef { return EventRef{Queue: e.Queue, ID: e.ID} }

// EventDelete deletes relayed events (the broker acknowledged them). On
// one PostgreSQL they are deleted by id; on Citus one statement per queue
// names it, so each deletes on its queue's shard only.
func (s *Store) EventDelete(ctx context.Context, refs []EventRef) error {
	if len(refs) == 0 {
		return nil
	}
	ids := make([]int64, len(refs))
	for i, r := range refs {
		ids[i] = r.ID
	}
	var err error
	if !s.dist {
		_, err = s.pool.Exec(ctx, `DELETE FROM hipq_event WHERE id = ANY($1)`, ids)
	} else {
		byQueue := map[string][]int64{}
		for _, r := range refs {
			byQueue[r.Queue] = append(byQueue[r.Queue], r.ID)
		}
		var b pgx.Batch
		for _, q := range slices.Sorted(maps.Keys(byQueue)) {
			b.Queue(`DELETE FROM hipq_event WHERE queue = $1 AND id = ANY($2)`, q, byQueue[q])
		}
		err = s.pool.SendBatch(ctx, &b).Close()
	}
	if err != nil {
		return fmt.Errorf("delete relayed events: %w", err)
	}
	return nil
}

// EventsPending counts the pending events of each topic that has some.
func (s *Store) EventsPending(ctx context.Context) (map[string]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT topic, count(*) FROM hipq_event GROUP BY topic`)
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

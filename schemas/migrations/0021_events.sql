-- hipq schema, version 21: outcome events. A job may name its own
-- reply_to topic and carry its producer's hipq-correlation-* headers, which
-- its events copy back. hipq_event is the outbox inside hipq: the
-- statement that ends a job inserts its events (one row per topic) in the
-- same transaction, and the relay of the dispatcher role produces them to
-- Kafka after commit, deleting each row once the broker acknowledged it.
-- The row's id is the event's hipq-event-id.
--
-- reply_to    the topic the job's final event goes to (NULL: none)
-- correlation the hipq-correlation-* headers of its input, as a JSON array
--             of {"key", "value"} (value base64), in their order
ALTER TABLE hipq_job ADD COLUMN IF NOT EXISTS reply_to text;
ALTER TABLE hipq_job ADD COLUMN IF NOT EXISTS correlation jsonb;

CREATE TABLE IF NOT EXISTS hipq_event (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue        text        NOT NULL,
    topic        text        NOT NULL,
    job_id       bigint      NOT NULL,
    job_type     text        NOT NULL,
    job_key      text        NOT NULL,
    attempt      int         NOT NULL,
    outcome      text        NOT NULL,
    trace_parent text,
    headers      jsonb,
    value        jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- The relay reads each topic's pending events in id order, and finds the
-- topics with events pending one by one (a skip scan).
CREATE INDEX IF NOT EXISTS hipq_event_topic ON hipq_event (topic, id);

-- Rows come and go: vacuum it often, whatever its size.
ALTER TABLE hipq_event SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
                            autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 1000);

-- The relay is woken at commit by the trigger hipq_event_notify, defined
-- with its function in schemas/repeatable/hipq_event_notify.sql.

-- hipq: no transaction
-- hipq schema, version 27: a job's final event on its type's topic is read
-- from the job itself, not from a row of hipq_event. On one PostgreSQL the
-- statement that ends a job in a reply, a timeout or a dispatch error sets
-- its event_topic (its type's events.topic) and its event_id (from
-- hipq_event's own sequence: one order for both kinds of event); the relay
-- reads such jobs beside hipq_event's rows, in id order, and keeps how far
-- it relayed each topic in hipq_event_cursor (written with its deletes).
-- Retention never prunes a job whose event is above its topic's cursor. A
-- final job is never updated again, so what the relay reads is what ended
-- it. Attempt events, reply_to events, the other ways jobs end, and every
-- event on Citus, stay rows of hipq_event.
--
-- event_topic  the topic of the job's final event read from the job
-- event_id     that event's hipq-event-id; NULL: none read from the job
--
-- hipq_event_cursor: topic, and after (every event of the topic up to
-- this id was relayed, or never will be).
--
-- Adding columns without a default rewrites nothing. The index holds the
-- jobs whose event_id is set only; it is built CONCURRENTLY, outside a
-- transaction: writes go on while it reads the table. Run again after a
-- crash, each step drops an invalid half-built index (a brief lock) and
-- keeps a finished one.
ALTER TABLE hipq_job ADD COLUMN IF NOT EXISTS event_topic text, ADD COLUMN IF NOT EXISTS event_id bigint;

CREATE TABLE IF NOT EXISTS hipq_event_cursor (
    topic       text        PRIMARY KEY,
    after       bigint      NOT NULL,
    update_time timestamptz NOT NULL DEFAULT now()
);

DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'hipq_job_event' AND c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid) THEN DROP INDEX hipq_job_event; END IF; END $$;
CREATE INDEX CONCURRENTLY IF NOT EXISTS hipq_job_event ON hipq_job (event_topic, event_id) WHERE event_id IS NOT NULL;

-- hipq schema, version 4: the transactional outbox. An application writes
-- a job request with one plain INSERT inside its own transaction; the row
-- exists if and only if that transaction commits, and hipq's intake role
-- turns it into a job, deleting the row in the same transaction as the job
-- row. The columns are a public contract, like the Kafka intake message:
--
--   INSERT INTO hipq_intake (value) VALUES ('{"job_type": "...", "job_key": "...", "job_data": {...}}');
--
-- value   the intake JSON (SPEC §4): job_type, job_key, job_data and the
--         optional scheduling fields; defaults come from hipq's config
-- headers an optional JSON object of string values (e.g. traceparent)
-- Other columns have defaults and may grow; an application names the
-- columns it writes.
CREATE TABLE hipq_intake (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    value      text        NOT NULL,
    headers    jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Rows come and go: vacuum it often, whatever its size.
ALTER TABLE hipq_intake SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
                             autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 1000);

-- Wake the drainers at commit (a notification is sent only if the
-- transaction commits, once per transaction however many rows it wrote).
CREATE FUNCTION hipq_intake_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('hipq_intake', '');
    RETURN NULL;
END $$;
CREATE TRIGGER hipq_intake_notify AFTER INSERT ON hipq_intake
    FOR EACH STATEMENT EXECUTE FUNCTION hipq_intake_notify();

-- Dead letters of outbox rows.
ALTER TABLE hipq_dead_letter DROP CONSTRAINT hipq_dead_letter_source_check;
ALTER TABLE hipq_dead_letter ADD CONSTRAINT hipq_dead_letter_source_check
    CHECK (source IN ('intake', 'reply', 'callback', 'outbox'));

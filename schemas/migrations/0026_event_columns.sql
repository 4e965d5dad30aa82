-- hipq schema, version 26: an outcome event's value is built by the relay
-- from the event's columns, not by the statement that ends its job. The
-- statements that end jobs are the hot path: building the JSON there
-- (its timestamps as text) cost more than the rest of the event's insert,
-- and reading it back cost a conversion more; the relay writes the same
-- JSON from these columns.
--
-- state          the job's state after the move (final or retry)
-- result         the job's result
-- error          the job's error, NULL when it has none
-- job_created_at when the job was made
-- finished_at    when the job (or the attempt) ended
--
-- value stays for the events written before (the relay sends it when it
-- is set) and is NULL for those written from this version on. Adding
-- columns without a default rewrites nothing: safe to run again.
ALTER TABLE hipq_event ADD COLUMN IF NOT EXISTS state text,
                       ADD COLUMN IF NOT EXISTS result jsonb,
                       ADD COLUMN IF NOT EXISTS error text,
                       ADD COLUMN IF NOT EXISTS job_created_at timestamptz,
                       ADD COLUMN IF NOT EXISTS finished_at timestamptz,
                       ALTER COLUMN value DROP NOT NULL;

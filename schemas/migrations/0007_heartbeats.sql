-- hipq schema, version 7: heartbeats and progress. News of a running
-- attempt (a progress reply, a POST to its heartbeat URL) moves the
-- attempt's deadline and records what it said. Kept on the attempt, so a
-- new attempt starts from its own timeout by construction. NULL deadline:
-- started_at + timeout_seconds, as before. Columns added NULL: no table
-- rewrite.
ALTER TABLE hipq_attempt ADD COLUMN deadline timestamptz,
                         ADD COLUMN progress jsonb,
                         ADD COLUMN progress_at timestamptz;

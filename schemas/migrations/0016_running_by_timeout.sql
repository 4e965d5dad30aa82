-- hipq: no transaction
-- hipq schema, version 16: running jobs are indexed by queue, then
-- timeout_seconds, then started_at (hipq_job_running_timeout), in place of
-- queue, then started_at (hipq_job_running). The sweeper's timeouts read
-- the jobs whose time is up and no others: for each timeout_seconds a
-- queue's running jobs have (a skip scan of the index: a few values,
-- however many jobs), the range started_at < now() - that timeout. By
-- started_at alone, every running job had to be read at every sweep
-- (its deadline, started_at + timeout_seconds, cannot be searched for),
-- 1.1 s a sweep beside a million jobs awaiting late replies. The index
-- has as many entries as the one it replaces (one per running job), so
-- claims write no more. The old claims the search for unsent requests
-- reads are still a range (of each timeout's started_at).
--
-- Built CONCURRENTLY, outside a transaction: writes go on while it reads
-- the table. Run again after a crash, it drops an invalid half-built
-- index (a brief lock) and keeps a finished one.
DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'hipq_job_running_timeout' AND c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid) THEN DROP INDEX hipq_job_running_timeout; END IF; END $$;
CREATE INDEX CONCURRENTLY IF NOT EXISTS hipq_job_running_timeout ON hipq_job (queue, timeout_seconds, started_at) WHERE state = 'running';
DROP INDEX CONCURRENTLY IF EXISTS hipq_job_running;

-- hipq: no transaction
-- hipq schema, version 19: the due indexes lead with the queue, then the
-- job type (hipq_job_due_type_sched, hipq_job_due_type_prio), in place of
-- the queue alone. A claim or a probe reads the due jobs of the types it
-- may take, each type's from its own range of the index: a backlog of
-- another type of the queue (its topic refusing, its type capped, or sent
-- by other instances) is never walked. The indexes have as many entries as
-- those they replace, so writes cost no more.
--
-- Built CONCURRENTLY, outside a transaction: writes go on while they read
-- the table. Run again after a crash, each step drops an invalid
-- half-built index (a brief lock) and keeps a finished one.
DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'hipq_job_due_type_sched' AND c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid) THEN DROP INDEX hipq_job_due_type_sched; END IF; END $$;
CREATE INDEX CONCURRENTLY IF NOT EXISTS hipq_job_due_type_sched ON hipq_job (queue, job_type, scheduled_run_time, priority, id) WHERE state IN ('initial', 'retry');
DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'hipq_job_due_type_prio' AND c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid) THEN DROP INDEX hipq_job_due_type_prio; END IF; END $$;
CREATE INDEX CONCURRENTLY IF NOT EXISTS hipq_job_due_type_prio ON hipq_job (queue, job_type, priority, scheduled_run_time, id) WHERE state IN ('initial', 'retry');
DROP INDEX CONCURRENTLY IF EXISTS hipq_job_due_sched;
DROP INDEX CONCURRENTLY IF EXISTS hipq_job_due_prio;

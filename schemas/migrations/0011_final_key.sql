-- hipq: no transaction
-- hipq schema, version 11: a job's (job_type, job_key) index holds its
-- final version only. A job is written three times (intake, claim,
-- outcome) and none of these updates is HOT, so every index of every
-- version gains an entry: the full index took three per job. Waiting and
-- running jobs are found by hipq_job_active_key (unique, non-final); final
-- ones by this index. Built CONCURRENTLY, outside a transaction: writes go
-- on while it reads the table. Run again after a crash, it drops an
-- invalid half-built index (a brief lock) and keeps a finished one.
DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'hipq_job_final_key' AND c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid) THEN DROP INDEX hipq_job_final_key; END IF; END $$;
CREATE INDEX CONCURRENTLY IF NOT EXISTS hipq_job_final_key ON hipq_job (job_type, job_key, id) WHERE state = 'final';
DROP INDEX CONCURRENTLY IF EXISTS hipq_job_key;

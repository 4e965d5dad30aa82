-- hipq: no transaction
-- hipq schema, version 11: a job's (job_type, job_key) index holds its
-- final version only. A job is written three times (intake, claim,
-- outcome) and none of these updates is HOT, so every index of every
-- version gains an entry: the full index took three per job. Waiting and
-- running jobs are found by hipq_job_active_key (unique, non-final); final
-- ones by this index. Built CONCURRENTLY, outside a transaction: writes go
-- on while it reads the table (a crash midway leaves an invalid index,
-- which the first statement drops when the migration runs again).
DROP INDEX CONCURRENTLY IF EXISTS hipq_job_final_key;
CREATE INDEX CONCURRENTLY hipq_job_final_key ON hipq_job (job_type, job_key, id) WHERE state = 'final';
DROP INDEX CONCURRENTLY IF EXISTS hipq_job_key;

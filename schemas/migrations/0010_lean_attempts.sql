-- hipq schema, version 10: leaner attempt rows. An attempt is written
-- three times (claim, sent mark, outcome); with only its primary key
-- indexed and room left on each page, the two updates are HOT (no index
-- entry, less WAL). The unsent claims are found through the running jobs
-- instead of a partial index of their own, and retention deletes a job's
-- attempts itself instead of a foreign key checking every insert.
ALTER TABLE hipq_attempt DROP CONSTRAINT hipq_attempt_job_id_fkey;
DROP INDEX hipq_attempt_unsent;
ALTER TABLE hipq_attempt SET (fillfactor = 60);

-- hipq: no transaction
-- hipq schema, version 13: every statement that moves or locks a job names
-- its queue. An attempt row carries its job's queue (the claim writes it),
-- so the statements that end, mark or undo attempts select them by queue
-- as well as by key: with hipq_job and hipq_attempt distributed by queue
-- (Citus), each is then a single-shard statement. The claim of this
-- version was version 12's with the queue written on attempt rows and
-- named by every statement that writes.
--
-- Outside a transaction, so that the attempts of a big table get their
-- queue without stopping the writes: the column is added (no rewrite),
-- the claim replaced (from then on every new attempt has its queue), the
-- older rows filled in batches of 10,000 jobs, each committed, and only
-- then is the column made NOT NULL (checked by a constraint validated
-- while writes go on; the NOT NULL itself is then a brief lock). Each step
-- may run again after a crash.
ALTER TABLE hipq_attempt ADD COLUMN IF NOT EXISTS queue text;

-- (The claim's SQL function that this version defined or changed is no
-- longer kept here: the claim is decided in Go since version 20, which drops
-- whatever version of it a database holds.)

DO $$
DECLARE
    lo bigint;
    hi bigint;
BEGIN
    SELECT min(job_id), max(job_id) INTO lo, hi FROM hipq_attempt;
    WHILE lo <= hi LOOP
        UPDATE hipq_attempt a SET queue = j.queue FROM hipq_job j
        WHERE j.id = a.job_id AND a.job_id >= lo AND a.job_id < lo + 10000 AND a.queue IS NULL;
        COMMIT;
        lo := lo + 10000;
    END LOOP;
END $$;
-- A claim that was running the old function as it was replaced: its rows.
UPDATE hipq_attempt a SET queue = j.queue FROM hipq_job j WHERE j.id = a.job_id AND a.queue IS NULL;
-- Attempts whose job is gone (there should be none: every path deletes a
-- job's attempts in the statement that deletes the job) belong to no
-- queue and are of no use: they go. (Never a row whose job exists: a claim
-- still running the old function may commit one at any moment.)
DELETE FROM hipq_attempt a WHERE a.queue IS NULL AND NOT EXISTS (SELECT 1 FROM hipq_job j WHERE j.id = a.job_id);
-- From here no row without a queue is accepted (an old claim still
-- inserting one fails, and its jobs are claimed again); the rows such
-- claims committed meanwhile are filled once more, then the constraint is
-- validated while writes go on.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'hipq_attempt_queue_set'
                   AND conrelid = 'hipq_attempt'::regclass) THEN
        ALTER TABLE hipq_attempt ADD CONSTRAINT hipq_attempt_queue_set CHECK (queue IS NOT NULL) NOT VALID;
    END IF;
END $$;
UPDATE hipq_attempt a SET queue = j.queue FROM hipq_job j WHERE j.id = a.job_id AND a.queue IS NULL;
DELETE FROM hipq_attempt a WHERE a.queue IS NULL AND NOT EXISTS (SELECT 1 FROM hipq_job j WHERE j.id = a.job_id);
ALTER TABLE hipq_attempt VALIDATE CONSTRAINT hipq_attempt_queue_set;
ALTER TABLE hipq_attempt ALTER COLUMN queue SET NOT NULL;
ALTER TABLE hipq_attempt DROP CONSTRAINT IF EXISTS hipq_attempt_queue_set;

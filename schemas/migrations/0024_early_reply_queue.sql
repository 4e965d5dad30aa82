-- hipq schema, version 24: an early reply carries the queue of the job it
-- waits for. The store writes it with every early reply it keeps: the
-- queue of the reply's job when there is one (a job not dispatched yet),
-- else the queue its type has in the config (a reply whose type is not
-- configured is dead-lettered, never kept). On Citus hipq_early_reply is
-- then distributed by queue, co-located with hipq_job, so that keeping,
-- reading and deleting early replies are single-shard statements beside
-- the jobs' own.
--
-- The replies kept before this version get the queue of the job they
-- name: by job id, else the non-final job of their type and key. A reply
-- whose job does not exist yet (the usual early reply) names no row that
-- tells its queue, and SQL cannot read the config: it keeps a null queue.
-- That loses nothing. On one PostgreSQL no statement reads an early
-- reply's queue (replies are matched by job id or by type and key, and
-- deleted by id), so such a reply still matches its job when it is sent,
-- or is dead-lettered past responses.early_ttl, as before. On Citus a
-- table with rows moves only by hipq migrate --distribute, which reads the
-- config: it gives each such reply its type's queue, and dead-letters
-- (unknown_job_type) those whose type the config does not name, as the
-- sweep would, before the table is distributed. No reply is deleted here.
--
-- Safe to run again: the fill runs only while some reply has no queue
-- (never on Citus once the table is distributed, where queue is the
-- distribution column, which Citus refuses to set in any UPDATE).
ALTER TABLE hipq_early_reply ADD COLUMN IF NOT EXISTS queue text;
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM hipq_early_reply WHERE queue IS NULL) THEN
        UPDATE hipq_early_reply e SET queue = j.queue FROM hipq_job j
        WHERE e.queue IS NULL AND e.job_id IS NOT NULL AND j.id = e.job_id;
        UPDATE hipq_early_reply e SET queue = j.queue FROM hipq_job j
        WHERE e.queue IS NULL AND j.job_type = e.job_type AND j.job_key = e.job_key AND j.state <> 'final';
    END IF;
END $$;

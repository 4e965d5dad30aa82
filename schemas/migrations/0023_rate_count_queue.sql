-- hipq schema, version 23: a rate window's count names its queue.
--
-- A rate belongs to one queue: a queue's rates (keys q:QUEUE#k) to that
-- queue, a job type's (t:TYPE#k) to the type's queue, and only that
-- queue's claims, under its claim lock, write the rate's units and
-- counts. hipq_rate_count now carries that queue, as hipq_rate_unit does
-- since version 17, so that on Citus it is distributed by queue with the
-- jobs whose claims write it (its key there is (queue, rate, part)). On
-- one PostgreSQL a window is still found by its rate and part, and its
-- queue is the one whose claim first counted in it.
ALTER TABLE hipq_rate_count ADD COLUMN IF NOT EXISTS queue text;

-- Units from before version 17 get their queue too: a queue's rate's from
-- its key (the name is all but the last "#k", whatever the name holds),
-- a type's from its jobs' (one claim's, of one queue). Then each window's
-- count: a queue's rate's, the queue its key names; a type's, the queue
-- of the window's latest unit, else of the rate's latest unit. (In blocks
-- that run only where rows lack a queue: on Citus, where the queue is the
-- tables' distribution column, in their key, there are none, and these
-- updates of it, which Citus refuses to plan, are never planned.)
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM hipq_rate_unit WHERE queue IS NULL) THEN
        UPDATE hipq_rate_unit SET queue = substring(rate FROM '^q:(.*)#[0-9]+$')
        WHERE queue IS NULL AND rate LIKE 'q:%';
        UPDATE hipq_rate_unit u SET queue = j.queue FROM hipq_job j
        WHERE u.queue IS NULL AND j.id = u.job_ids[1];
    END IF;
END $$;
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM hipq_rate_count WHERE queue IS NULL) THEN
        UPDATE hipq_rate_count SET queue = substring(rate FROM '^q:(.*)#[0-9]+$')
        WHERE queue IS NULL AND rate LIKE 'q:%';
        UPDATE hipq_rate_count c SET queue = u.queue
        FROM (SELECT DISTINCT ON (rate, part) rate, part, queue FROM hipq_rate_unit
              WHERE queue IS NOT NULL ORDER BY rate, part, id DESC) u
        WHERE c.queue IS NULL AND u.rate = c.rate AND u.part = c.part;
        UPDATE hipq_rate_count c SET queue = u.queue
        FROM (SELECT DISTINCT ON (rate) rate, queue FROM hipq_rate_unit
              WHERE queue IS NOT NULL ORDER BY rate, id DESC) u
        WHERE c.queue IS NULL AND u.rate = c.rate;
    END IF;
END $$;
-- A window left without a queue has no unit with one: its units are from
-- before version 17 and their jobs are gone, or it has none. It is kept
-- as it is, and no row is deleted here (the column stays nullable, as
-- hipq_rate_unit's is): on one PostgreSQL it goes on counting by rate and
-- part, and hipq migrate --distribute lays the counts out for Citus from
-- the units themselves (a window's count is the sum of its units' n).

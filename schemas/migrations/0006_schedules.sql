-- hipq schema, version 6: periodic jobs. One row per configured schedule
-- keeps the tick it last fired; a fire inserts its job and moves last_fire
-- by compare-and-set in one transaction, so each tick fires once across
-- instances and restarts (the job key's unique index covers only non-final
-- jobs, so it alone could not say a tick already ran).
CREATE TABLE hipq_schedule (
    name         text PRIMARY KEY,
    -- the latest tick fired or passed over; a new schedule starts at its
    -- creation time, so it never backfills
    last_fire    timestamptz NOT NULL,
    paused       boolean NOT NULL DEFAULT false,
    -- the key of the last job a tick (or a trigger) enqueued: overlap: skip
    -- waits for it to be final
    last_job_type text,
    last_job_key text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    update_time  timestamptz NOT NULL DEFAULT now()
);

-- hipq schema, version 25: what lets instances connected to any node of a
-- Citus cluster exclude each other. An advisory lock is held on the node
-- that took it only, so on Citus:
-- - the claim lock of a queue with limits is also a row lock of the
--   queue's row in hipq_claim_lock, distributed by queue and co-located
--   with hipq_job: the lock lies on the queue's own shard, on the worker
--   the claim runs on;
-- - the roles of one instance at a time (the sweeper, the outcome events'
--   relay) hold a lease in hipq_lock (the coordinator's table, reached from
--   any node): holder keeps it by moving until on, and another instance
--   takes it once until has passed.
-- On one PostgreSQL both stay empty: advisory locks are the database's own
-- there. Safe to run again (IF NOT EXISTS).
CREATE TABLE IF NOT EXISTS hipq_claim_lock (
    queue      text        PRIMARY KEY,
    claimed_at timestamptz NOT NULL
);

CREATE TABLE IF NOT EXISTS hipq_lock (
    name   text        PRIMARY KEY,
    holder text        NOT NULL,
    until  timestamptz NOT NULL
);

-- hipq schema, version 9: activity per minute, for the dashboard. Each
-- instance adds what it counted in memory (sends, replies that ended an
-- attempt) to its own row of the minute, a write every few seconds
-- whatever the load, so the dashboard's chart never counts attempts.
-- Rows older than a day are pruned by the instances that write them.
CREATE TABLE hipq_activity (
    minute     timestamptz NOT NULL,
    instance   text        NOT NULL,
    queue      text        NOT NULL,
    dispatched bigint      NOT NULL DEFAULT 0,
    replied    bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, instance, queue)
);

-- hipq schema, version 8: rate limits. A sliding window per rate (queue,
-- type, or a window per value of a job_data field): no interval of length
-- period holds more than limit requests that may have reached the
-- downstream, across every instance, durable across restarts.
--
-- hipq_rate_unit: the requests one claim made under one window (rate,
-- part): their attempts, how many still count (n), and at, an upper bound
-- of when the last of them may have arrived: the latest acknowledged send
-- (sent_at), or a moment after an attempt ended unsent (a send in doubt,
-- a timeout, a cancel); NULL while any may still be in flight. Claims
-- time the rows, under the queue's lock, so no hot path pays for rates;
-- an undone claim (its request surely never left) deletes its attempt,
-- and the next claim takes it out of n. One row per claim and window, not
-- per request: the bookkeeping costs a few writes per batch.
CREATE TABLE hipq_rate_unit (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rate     text     NOT NULL,
    part     text     NOT NULL,
    job_ids  bigint[] NOT NULL,
    attempts int[]    NOT NULL,
    n        int      NOT NULL,
    at       timestamptz
);
-- Claims find a rate's untimed and expired rows by it.
CREATE INDEX hipq_rate_unit_window ON hipq_rate_unit (rate, at);

-- hipq_rate_count: how many requests each (rate, part) counts (the sum of
-- its rows' n), kept with them (claim: +, prune and undo: -), so a claim
-- reads one row per window rather than adding a window's rows.
CREATE TABLE hipq_rate_count (
    rate text NOT NULL,
    part text NOT NULL,
    n    int  NOT NULL,
    PRIMARY KEY (rate, part)
);

-- (The claim's SQL function that this version defined or changed is no
-- longer kept here: the claim is decided in Go since version 20, which drops
-- whatever version of it a database holds.)


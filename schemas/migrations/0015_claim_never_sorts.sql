-- hipq schema, version 15: the claim's plans no longer follow statistics.
-- Every statement of hipq_claim reaches its rows through an index or by
-- tuple id: the pick reads the first due jobs of the queue's order from
-- that order's due index (hipq_job_due_sched or hipq_job_due_prio), which
-- costs the batch and the rows it skips (locked by another claim, outside
-- the claimed types), and the move finds what it picked by tuple id or
-- key. PostgreSQL chose otherwise whenever statistics made the due jobs
-- look few (taken before a burst, lacking the job_type column, or
-- underestimating a throttled claim's filters): it sorted every due job
-- at each claim (47,000 rows, on disk, 200 ms a claim in hipq bench
-- --instances 2), and a throttled queue's move scanned the whole table.
-- Sorts and sequential scans are disabled for the function's statements,
-- so the indexes are the only plans left; a statement that cannot avoid a
-- sort (returning the claimed jobs in their order) still runs one, and so
-- costs more than jit_above_cost: JIT is off for the function too (it
-- compiled them at every call, 400 ms a claim). A later CREATE OR REPLACE
-- of hipq_claim resets these settings and must repeat them
-- (TestClaimFastPathPlans checks them).
ALTER FUNCTION hipq_claim(text, text, int, text, text[], jsonb, int, text[], jsonb, text[], jsonb, int, jsonb)
    SET enable_sort = off;
ALTER FUNCTION hipq_claim(text, text, int, text, text[], jsonb, int, text[], jsonb, text[], jsonb, int, jsonb)
    SET enable_seqscan = off;
ALTER FUNCTION hipq_claim(text, text, int, text, text[], jsonb, int, text[], jsonb, text[], jsonb, int, jsonb)
    SET jit = off;

-- hipq schema, version 12: the claim of a queue without limits (no
-- throttle, per-type cap or rate; most queues) is two statements: one
-- picks and locks the due jobs in the queue's order, the next moves them
-- by their tuple ids and writes their attempt rows. No walk of the
-- candidates in PL/pgSQL (arrays grown a job at a time, a candidate query
-- planned at every call). What it did was unchanged.

-- (The claim's SQL function that this version defined or changed is no
-- longer kept here: the claim is decided in Go since version 20, which drops
-- whatever version of it a database holds.)

-- hipq schema, version 20: the claim is decided in Go (correlator.PlanClaim)
-- and read and written by plain statements of the store, so the SQL
-- functions that decided it leave the schema: hipq_claim and the time
-- window test it used. A hipq of an earlier version still running while
-- this one migrates finds no claim function: its claims fail, and it
-- tries again, until it is replaced.
DROP FUNCTION IF EXISTS hipq_claim(text, text, int, text, text[], jsonb, int, text[], jsonb, text[], jsonb, int, jsonb);
DROP FUNCTION IF EXISTS hipq_window_open(jsonb, timestamptz);

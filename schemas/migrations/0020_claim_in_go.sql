-- hipq schema, version 20: the claim is decided in Go (correlator.PlanClaim)
-- and read and written by plain statements of the store, so the SQL
-- functions that decided it leave the schema: hipq_claim and the time
-- window test it used. A hipq of an earlier version still running while
-- this one migrates finds no claim function: its claims fail, and it
-- tries again, until it is replaced. Every version of either function a
-- database holds goes, whatever its arguments.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.proname IN ('hipq_claim', 'hipq_window_open') AND p.pronamespace = current_schema()::regnamespace LOOP
        EXECUTE format('DROP FUNCTION %s', f);
    END LOOP;
END $$;

-- hipq_intake_notify wakes the outbox drainers at commit: the trigger
-- hipq_intake_notify (AFTER INSERT ON hipq_intake FOR EACH STATEMENT,
-- created by version 4) runs it, and a notification is sent only if the
-- transaction commits, once per transaction however many rows it wrote.
-- The trigger itself stays in its versioned migration: re-creating it here
-- would take a lock on hipq_intake, which applications write to in their
-- own transactions, each time this text changes.
CREATE OR REPLACE FUNCTION hipq_intake_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('hipq_intake', '');
    RETURN NULL;
END $$;

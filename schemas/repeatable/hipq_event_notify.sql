-- hipq_event_notify wakes the events relay at commit: the trigger of the
-- same name runs it after each statement that inserts into hipq_event (the
-- statements that end jobs), and a notification is sent only if the
-- transaction commits, once per transaction however many rows it wrote,
-- and none for a statement that wrote no event. Only hipq writes
-- hipq_event, so re-creating the trigger here, which locks the table,
-- waits for nobody else's transactions.
CREATE OR REPLACE FUNCTION hipq_event_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM hipq_event_new) THEN
        PERFORM pg_notify('hipq_event', '');
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER hipq_event_notify AFTER INSERT ON hipq_event REFERENCING NEW TABLE AS hipq_event_new
    FOR EACH STATEMENT EXECUTE FUNCTION hipq_event_notify();

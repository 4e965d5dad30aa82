-- hipq_event_notify wakes the events relay at commit: the trigger of the
-- same name runs it after each statement that inserts into hipq_event (the
-- statements that end jobs), and a notification is sent only if the
-- transaction commits, once per transaction for the same topics however
-- many rows it wrote, and none for a statement that wrote no event. Its
-- payload names the topics written to, comma-separated (no topic name
-- holds a comma), so the relay drains those without looking for the
-- topics with events pending; empty (look at every topic) when the names
-- would not fit a notification's payload. Only hipq writes hipq_event, so
-- re-creating the trigger here, which locks the table, waits for nobody
-- else's transactions.
CREATE OR REPLACE FUNCTION hipq_event_notify() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    topics text;
BEGIN
    SELECT string_agg(DISTINCT topic, ',' ORDER BY topic) INTO topics FROM hipq_event_new;
    IF topics IS NOT NULL THEN
        PERFORM pg_notify('hipq_event', CASE WHEN octet_length(topics) < 7000 THEN topics ELSE '' END);
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER hipq_event_notify AFTER INSERT ON hipq_event REFERENCING NEW TABLE AS hipq_event_new
    FOR EACH STATEMENT EXECUTE FUNCTION hipq_event_notify();

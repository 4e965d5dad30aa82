-- hipq_window_open reports whether instant t falls inside any of windows, a
-- jsonb array of {"start": "HH:MM", "end": "HH:MM", "tz": "Area/City"}
-- ([start, end) in wall-clock time of tz; start = end is all day; end before
-- start crosses midnight). NULL or an empty array means no windows: open.
-- It must agree with correlator.TimeWindow.Contains (a test holds them to
-- it). A window PostgreSQL cannot read (a zone it does not know) counts as
-- open, so a job is never held back by a disagreement of time zone data.
CREATE OR REPLACE FUNCTION hipq_window_open(windows jsonb, t timestamptz) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    w  jsonb;
    s  time;
    e  time;
    lt time;
BEGIN
    IF windows IS NULL OR jsonb_typeof(windows) <> 'array' OR jsonb_array_length(windows) = 0 THEN
        RETURN true;
    END IF;
    BEGIN  -- an exception block costs a subtransaction: only jobs with windows pay it
        FOR w IN SELECT value FROM jsonb_array_elements(windows) LOOP
            s := (w ->> 'start')::time;
            e := (w ->> 'end')::time;
            IF s = e THEN
                RETURN true;
            END IF;
            lt := (t AT TIME ZONE coalesce(nullif(w ->> 'tz', ''), 'UTC'))::time;
            IF (s < e AND lt >= s AND lt < e) OR (s > e AND (lt >= s OR lt < e)) THEN
                RETURN true;
            END IF;
        END LOOP;
        RETURN false;
    EXCEPTION WHEN OTHERS THEN
        RETURN true;
    END;
END $$;

-- hipq schema, version 2: the claim as one server-side call, so throttles,
-- shares, per-type caps and time windows cost one round trip per batch.

-- hipq_window_open reports whether instant t falls inside any of windows, a
-- jsonb array of {"start": "HH:MM", "end": "HH:MM", "tz": "Area/City"}
-- ([start, end) in wall-clock time of tz; start = end is all day; end before
-- start crosses midnight). NULL or an empty array means no windows: open.
-- It must agree with correlator.TimeWindow.Contains (a test holds them to
-- it). A window PostgreSQL cannot read (a zone it does not know) counts as
-- open, so a job is never held back by a disagreement of time zone data.
CREATE FUNCTION hipq_window_open(windows jsonb, t timestamptz) RETURNS boolean
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
END $$;

-- hipq_claim moves due jobs of one queue to running (attempt + 1,
-- started_at, a hipq_attempt row each) and returns them with claimed =
-- true. Due jobs found outside their time windows are not claimed: they are
-- returned with claimed = false for the caller to reschedule (the window
-- maths with daylight-saving gaps lives in Go).
--
-- A queue with a throttle (p_limit >= 1, or a per-type cap) is claimed under
-- an advisory transaction lock of the queue, so dispatchers on many
-- instances claim one after the other and each counts what the others
-- claimed: the limits hold across all of them. Jobs are taken in the
-- queue's order; a job that does not fit what is left (queue capacity, its
-- share partition, its type's cap) is skipped and lighter ones behind it
-- may run. Every statement inside runs on a fresh snapshot, taken after the
-- lock.
--
-- p_type_windows maps job type to its windows, for jobs without their own.
-- p_share_caps maps a listed partition value to its cap; p_share_other_cap
-- bounds every other value (NULL = unbounded); p_share_path NULL = no
-- shares. p_max_concurrency maps a job type to its cap.
CREATE FUNCTION hipq_claim(
    p_queue text, p_order text, p_batch int, p_instance text, p_types text[],
    p_type_windows jsonb, p_limit int, p_critical text[], p_max_concurrency jsonb,
    p_share_path text[], p_share_caps jsonb, p_share_other_cap int)
RETURNS TABLE (claimed boolean, id bigint, job_type text, job_key text, job_data jsonb,
               state text, attempt int, max_attempts int, timeout_seconds int,
               expires_at timestamptz, time_windows jsonb, started_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    v_bounded   boolean := p_limit >= 1 OR coalesce(p_max_concurrency, '{}') <> '{}';
    v_cap       int := CASE WHEN p_limit >= 1 THEN p_limit ELSE 2147483647 END;
    v_critical  text[] := coalesce(p_critical, '{}');
    v_used      int := 0;         -- throttle_factor of running non-critical jobs
    v_type_used jsonb := '{}';    -- running jobs per capped type
    v_part_used jsonb := '{}';    -- throttle_factor of running jobs per partition
    v_full_type text[] := '{}';
    v_full_part text[] := '{}';
    v_other_full boolean := false;
    v_scan      int;
    v_pick      bigint[] := '{}';
    v_pick_st   text[] := '{}';
    v_pick_att  int[] := '{}';
    v_out       bigint[] := '{}';
    v_part      text;
    v_pcap      int;
    v_tcap      int;
    v_n         int;
    v_order     text;
    cur         refcursor;
    r           record;
BEGIN
    IF EXISTS (SELECT 1 FROM hipq_queue q WHERE q.name = p_queue AND q.paused) THEN
        RETURN;
    END IF;
    v_order := CASE WHEN p_order = 'priority_first' THEN 'priority, scheduled_run_time, id'
                    ELSE 'scheduled_run_time, priority, id' END;
    IF v_bounded THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('hipq_claim/' || current_schema() || '/' || p_queue, 0));
        SELECT coalesce(sum(j.throttle_factor) FILTER (WHERE NOT j.job_type = ANY(v_critical)), 0)
          INTO v_used
          FROM hipq_job j WHERE j.queue = p_queue AND j.state = 'running';
        IF p_max_concurrency IS NOT NULL THEN
            SELECT coalesce(jsonb_object_agg(t.job_type, t.n), '{}') INTO v_type_used
              FROM (SELECT j.job_type, count(*) AS n FROM hipq_job j
                    WHERE j.queue = p_queue AND j.state = 'running' AND p_max_concurrency ? j.job_type
                    GROUP BY j.job_type) t;
            SELECT coalesce(array_agg(k.key), '{}') INTO v_full_type
              FROM jsonb_each_text(p_max_concurrency) k
              WHERE coalesce((v_type_used ->> k.key)::int, 0) >= k.value::int;
        END IF;
        IF p_share_path IS NOT NULL THEN
            SELECT coalesce(jsonb_object_agg(t.part, t.used), '{}') INTO v_part_used
              FROM (SELECT CASE WHEN p_share_caps ? (j.job_data #>> p_share_path)
                                THEN j.job_data #>> p_share_path ELSE '*' END AS part,
                           sum(j.throttle_factor) AS used
                    FROM hipq_job j
                    WHERE j.queue = p_queue AND j.state = 'running' AND NOT j.job_type = ANY(v_critical)
                    GROUP BY 1) t;
            SELECT coalesce(array_agg(k.key), '{}') INTO v_full_part
              FROM jsonb_each_text(p_share_caps) k
              WHERE coalesce((v_part_used ->> k.key)::int, 0) >= k.value::int;
            v_other_full := p_share_other_cap IS NOT NULL
                            AND coalesce((v_part_used ->> '*')::int, 0) >= p_share_other_cap;
        END IF;
        IF v_used >= v_cap AND cardinality(v_critical) = 0 THEN
            RETURN;  -- full, and nothing here may pass a full queue
        END IF;
        -- Skips only happen for what fills up during this scan; the next
        -- claim starts from the full sets again, so the bound costs at most
        -- a round.
        v_scan := greatest(p_batch * 4, 1000);
    ELSE
        v_scan := p_batch;
    END IF;

    -- Candidates in the queue's order. What cannot run whatever happens in
    -- this scan (a full type or partition, a job heavier than the capacity
    -- left) is filtered out here, so it never crowds the scan.
    OPEN cur FOR EXECUTE format($q$
        SELECT j.id, j.job_type, j.state, j.attempt, j.throttle_factor,
               j.job_type = ANY($4) AS critical,
               CASE WHEN $5::text[] IS NULL THEN NULL ELSE j.job_data #>> $5 END AS part,
               coalesce(j.time_windows, $3 -> j.job_type) AS windows
        FROM hipq_job j
        WHERE j.queue = $1 AND j.state IN ('initial', 'retry') AND j.scheduled_run_time <= now()
          AND (j.expires_at IS NULL OR j.expires_at > now())
          AND ($2::text[] IS NULL OR j.job_type = ANY($2))
          AND NOT j.job_type = ANY($7)
          AND (j.job_type = ANY($4) OR (
                j.throttle_factor <= $6
                AND ($5::text[] IS NULL OR NOT CASE WHEN $9 ? (j.job_data #>> $5)
                                                    THEN (j.job_data #>> $5) = ANY($8)
                                                    ELSE $10 END)))
        ORDER BY %s
        LIMIT $11
        FOR UPDATE SKIP LOCKED$q$, v_order)
        USING p_queue, p_types, p_type_windows, v_critical, p_share_path, v_cap - v_used,
              v_full_type, v_full_part, coalesce(p_share_caps, '{}'), v_other_full, v_scan;
    LOOP
        FETCH cur INTO r;
        EXIT WHEN NOT FOUND;
        IF r.windows IS NOT NULL AND NOT hipq_window_open(r.windows, now()) THEN
            v_out := v_out || r.id;
            CONTINUE;
        END IF;
        IF v_bounded THEN
            v_tcap := (p_max_concurrency ->> r.job_type)::int;
            IF v_tcap IS NOT NULL AND coalesce((v_type_used ->> r.job_type)::int, 0) >= v_tcap THEN
                CONTINUE;
            END IF;
            IF NOT r.critical THEN
                IF r.throttle_factor > v_cap - v_used THEN
                    CONTINUE;
                END IF;
                IF p_share_path IS NOT NULL THEN
                    v_part := CASE WHEN p_share_caps ? r.part THEN r.part ELSE '*' END;
                    v_pcap := CASE WHEN v_part = '*' THEN p_share_other_cap ELSE (p_share_caps ->> v_part)::int END;
                    v_n := coalesce((v_part_used ->> v_part)::int, 0);
                    IF v_pcap IS NOT NULL AND v_n + r.throttle_factor > v_pcap THEN
                        CONTINUE;
                    END IF;
                    v_part_used := jsonb_set(v_part_used, ARRAY[v_part], to_jsonb(v_n + r.throttle_factor));
                END IF;
                v_used := v_used + r.throttle_factor;
            END IF;
            IF v_tcap IS NOT NULL THEN
                v_type_used := jsonb_set(v_type_used, ARRAY[r.job_type],
                                         to_jsonb(coalesce((v_type_used ->> r.job_type)::int, 0) + 1));
            END IF;
        END IF;
        v_pick := v_pick || r.id;
        v_pick_st := v_pick_st || r.state;
        v_pick_att := v_pick_att || r.attempt;
        EXIT WHEN cardinality(v_pick) >= p_batch;
        EXIT WHEN v_used >= v_cap AND cardinality(v_critical) = 0;
    END LOOP;
    CLOSE cur;

    RETURN QUERY
    WITH pick AS (
        SELECT * FROM unnest(v_pick, v_pick_st, v_pick_att) WITH ORDINALITY AS p(id, state, attempt, ord)
    ), moved AS (
        UPDATE hipq_job j
        SET state = 'running', attempt = j.attempt + 1, started_at = now(), update_time = now(), error = 'NONE'
        FROM pick
        WHERE j.id = pick.id AND j.state = pick.state AND j.attempt = pick.attempt
        RETURNING j.id, j.job_type, j.job_key, j.job_data, j.state, j.attempt, j.max_attempts,
                  j.timeout_seconds, j.expires_at, j.time_windows, j.started_at, pick.ord
    ), att AS (
        INSERT INTO hipq_attempt (job_id, attempt, instance, dispatched_at)
        SELECT m.id, m.attempt, p_instance, m.started_at FROM moved m
    )
    SELECT * FROM (
        SELECT true, m.id, m.job_type, m.job_key, m.job_data, m.state, m.attempt, m.max_attempts,
               m.timeout_seconds, m.expires_at, m.time_windows, m.started_at
        FROM moved m ORDER BY m.ord
    ) c
    UNION ALL
    SELECT false, j.id, j.job_type, j.job_key, NULL::jsonb, j.state, j.attempt, j.max_attempts,
           j.timeout_seconds, j.expires_at, j.time_windows, j.started_at
    FROM hipq_job j WHERE j.id = ANY(v_out);
END $$;

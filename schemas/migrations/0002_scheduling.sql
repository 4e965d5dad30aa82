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
    v_bounded  boolean := p_limit >= 1 OR coalesce(p_max_concurrency, '{}') <> '{}';
    v_order    text := CASE WHEN p_order = 'priority_first' THEN 'priority, scheduled_run_time, id'
                            ELSE 'scheduled_run_time, priority, id' END;
    v_critical text[] := coalesce(p_critical, '{}');
    v_cap      int := CASE WHEN p_limit >= 1 THEN p_limit ELSE 2147483647 END;
    v_used     int := 0;       -- throttle_factor of running non-critical jobs
    v_tnames   text[] := '{}'; -- capped types, their caps and running counts
    v_tcaps    int[] := '{}';
    v_tused    int[] := '{}';
    v_pnames   text[] := '{}'; -- share partitions ('*' last), caps (NULL = unbounded), running weight
    v_pcaps    int[] := '{}';
    v_pused    int[] := '{}';
    v_np       int := 0;
    v_full_type text[];
    v_full_part text[];
    v_other_full boolean := false;
    c_id bigint[]; c_state text[]; c_att int[]; c_factor int[]; c_type text[]; c_part text[]; c_open boolean[];
    v_pick     bigint[] := '{}';
    v_pick_st  text[] := '{}';
    v_pick_att int[] := '{}';
    v_out      bigint[] := '{}';
    i int; t int; p int;
    r record;
BEGIN
    IF EXISTS (SELECT 1 FROM hipq_queue q WHERE q.name = p_queue AND q.paused) THEN
        RETURN;
    END IF;

    IF v_bounded THEN
        -- One claimer of this queue at a time, across every instance. The
        -- statements below run on snapshots taken after the lock, so they
        -- count what the previous holder claimed. Rows are not locked
        -- while choosing: the final update is guarded by each row's state
        -- and attempt, so a row another writer moved meanwhile is simply
        -- not taken. Unbounded claims lock their candidates instead (SKIP
        -- LOCKED keeps concurrent dispatchers off each other's rows).
        PERFORM pg_advisory_xact_lock(hashtextextended('hipq_claim/' || current_schema() || '/' || p_queue, 0));
        SELECT coalesce(sum(j.throttle_factor) FILTER (WHERE NOT j.job_type = ANY(v_critical)), 0)
          INTO v_used
          FROM hipq_job j WHERE j.queue = p_queue AND j.state = 'running';
        IF v_used >= v_cap AND cardinality(v_critical) = 0 THEN
            RETURN;  -- full, and nothing here may pass a full queue
        END IF;
    END IF;

    IF p_max_concurrency IS NOT NULL THEN
        SELECT coalesce(array_agg(k.key ORDER BY k.key), '{}'), coalesce(array_agg(k.value::int ORDER BY k.key), '{}')
          INTO v_tnames, v_tcaps FROM jsonb_each_text(p_max_concurrency) k;
        v_tused := array_fill(0, ARRAY[cardinality(v_tnames)]);
        FOR r IN SELECT j.job_type, count(*)::int AS n FROM hipq_job j
                 WHERE j.queue = p_queue AND j.state = 'running' AND j.job_type = ANY(v_tnames)
                 GROUP BY j.job_type LOOP
            v_tused[array_position(v_tnames, r.job_type)] := r.n;
        END LOOP;
    END IF;
    v_full_type := ARRAY(SELECT v_tnames[k] FROM generate_subscripts(v_tnames, 1) k WHERE v_tused[k] >= v_tcaps[k]);

    IF p_share_path IS NOT NULL THEN
        SELECT coalesce(array_agg(k.key ORDER BY k.key), '{}'), coalesce(array_agg(k.value::int ORDER BY k.key), '{}')
          INTO v_pnames, v_pcaps FROM jsonb_each_text(p_share_caps) k;
        v_pnames := v_pnames || '*'::text;
        v_pcaps := v_pcaps || p_share_other_cap;
        v_np := cardinality(v_pnames);
        v_pused := array_fill(0, ARRAY[v_np]);
        FOR r IN SELECT CASE WHEN p_share_caps ? (j.job_data #>> p_share_path)
                             THEN j.job_data #>> p_share_path ELSE '*' END AS part,
                        sum(j.throttle_factor)::int AS used
                 FROM hipq_job j
                 WHERE j.queue = p_queue AND j.state = 'running' AND NOT j.job_type = ANY(v_critical)
                 GROUP BY 1 LOOP
            v_pused[array_position(v_pnames, r.part)] := r.used;
        END LOOP;
        v_full_part := ARRAY(SELECT v_pnames[k] FROM generate_subscripts(v_pnames, 1) k
                             WHERE k < v_np AND v_pused[k] >= v_pcaps[k]);
        v_other_full := v_pcaps[v_np] IS NOT NULL AND v_pused[v_np] >= v_pcaps[v_np];
    END IF;

    -- Candidates in the queue's order. What cannot run whatever happens in
    -- this claim (a full type or partition, a job heavier than the capacity
    -- left) is filtered out here, so it never crowds the scan.
    EXECUTE format($q$
        SELECT coalesce(array_agg(c.id), '{}'), array_agg(c.state), array_agg(c.attempt), array_agg(c.throttle_factor),
               array_agg(c.job_type), array_agg(c.part), array_agg(c.open)
        FROM (
            SELECT j.id, j.state, j.attempt, j.throttle_factor, j.job_type,
                   CASE WHEN $5::text[] IS NULL THEN NULL
                        WHEN $9 ? (j.job_data #>> $5) THEN j.job_data #>> $5 ELSE '*' END AS part,
                   CASE WHEN j.time_windows IS NULL AND NOT $3 ? j.job_type THEN true
                        ELSE hipq_window_open(coalesce(j.time_windows, $3 -> j.job_type), now()) END AS open
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
            %s
        ) c$q$, v_order, CASE WHEN v_bounded THEN '' ELSE 'FOR UPDATE SKIP LOCKED' END)
        INTO c_id, c_state, c_att, c_factor, c_type, c_part, c_open
        USING p_queue, p_types, coalesce(p_type_windows, '{}'), v_critical, p_share_path, v_cap - v_used,
              v_full_type, coalesce(v_full_part, '{}'), coalesce(p_share_caps, '{}'), v_other_full,
              CASE WHEN v_bounded THEN greatest(p_batch * 4, 1000) ELSE p_batch END;

    FOR i IN 1 .. cardinality(c_id) LOOP
        IF NOT c_open[i] THEN
            v_out := v_out || c_id[i];
            CONTINUE;
        END IF;
        IF NOT v_bounded THEN
            v_pick := v_pick || c_id[i];
            v_pick_st := v_pick_st || c_state[i];
            v_pick_att := v_pick_att || c_att[i];
            CONTINUE;
        END IF;
        t := array_position(v_tnames, c_type[i]);
        IF t IS NOT NULL AND v_tused[t] >= v_tcaps[t] THEN
            CONTINUE;
        END IF;
        IF NOT c_type[i] = ANY(v_critical) THEN
            IF c_factor[i] > v_cap - v_used THEN
                CONTINUE;
            END IF;
            IF v_np > 0 THEN
                p := array_position(v_pnames, c_part[i]);
                IF v_pcaps[p] IS NOT NULL AND v_pused[p] + c_factor[i] > v_pcaps[p] THEN
                    CONTINUE;
                END IF;
                v_pused[p] := v_pused[p] + c_factor[i];
            END IF;
            v_used := v_used + c_factor[i];
        END IF;
        IF t IS NOT NULL THEN
            v_tused[t] := v_tused[t] + 1;
        END IF;
        v_pick := v_pick || c_id[i];
        v_pick_st := v_pick_st || c_state[i];
        v_pick_att := v_pick_att || c_att[i];
        EXIT WHEN cardinality(v_pick) >= p_batch;
        EXIT WHEN v_used >= v_cap AND cardinality(v_critical) = 0;
    END LOOP;

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

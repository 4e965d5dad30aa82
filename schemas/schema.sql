-- hipq's schema at version 19, with its repeatable migrations applied, as
-- PostgreSQL's catalogs describe it. Written by `make schema`; TestSchemaSnapshot
-- (store) fails when the migrated schema differs. Do not edit.

CREATE TABLE hipq_activity (
    minute timestamp with time zone NOT NULL,
    instance text NOT NULL,
    queue text NOT NULL,
    dispatched bigint DEFAULT 0 NOT NULL,
    replied bigint DEFAULT 0 NOT NULL
);
ALTER TABLE hipq_activity ADD CONSTRAINT hipq_activity_pkey PRIMARY KEY (minute, instance, queue);

CREATE TABLE hipq_attempt (
    job_id bigint NOT NULL,
    attempt integer NOT NULL,
    instance text NOT NULL,
    dispatched_at timestamp with time zone DEFAULT now() NOT NULL,
    sent_at timestamp with time zone,
    replied_at timestamp with time zone,
    outcome text,
    error text,
    reply jsonb,
    trace_parent text,
    deadline timestamp with time zone,
    progress jsonb,
    progress_at timestamp with time zone,
    queue text NOT NULL
);
ALTER TABLE hipq_attempt SET (fillfactor=60);
ALTER TABLE hipq_attempt ADD CONSTRAINT hipq_attempt_outcome_check CHECK (outcome = ANY (ARRAY['succeeded'::text, 'failed'::text, 'timed_out'::text, 'dispatch_error'::text, 'cancelled'::text]));
ALTER TABLE hipq_attempt ADD CONSTRAINT hipq_attempt_pkey PRIMARY KEY (job_id, attempt);

CREATE TABLE hipq_dead_letter (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    source text NOT NULL,
    topic text,
    kafka_partition integer,
    kafka_offset bigint,
    record_key bytea,
    record_value bytea,
    headers jsonb DEFAULT '[]'::jsonb NOT NULL,
    reason text NOT NULL,
    received_at timestamp with time zone DEFAULT now() NOT NULL,
    replayed_at timestamp with time zone
);
ALTER TABLE hipq_dead_letter ADD CONSTRAINT hipq_dead_letter_pkey PRIMARY KEY (id);
ALTER TABLE hipq_dead_letter ADD CONSTRAINT hipq_dead_letter_source_check CHECK (source = ANY (ARRAY['intake'::text, 'reply'::text, 'callback'::text, 'outbox'::text]));
CREATE INDEX hipq_dead_letter_list_source ON hipq_dead_letter USING btree (source, id);
CREATE INDEX hipq_dead_letter_received ON hipq_dead_letter USING btree (received_at);

CREATE TABLE hipq_early_reply (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    job_type text NOT NULL,
    job_key text NOT NULL,
    job_id bigint,
    attempt integer,
    success boolean NOT NULL,
    retryable boolean NOT NULL,
    error_text text DEFAULT ''::text NOT NULL,
    reply jsonb NOT NULL,
    headers jsonb DEFAULT '[]'::jsonb NOT NULL,
    source text DEFAULT 'reply'::text NOT NULL,
    topic text,
    kafka_partition integer,
    kafka_offset bigint,
    record_key bytea,
    record_value bytea,
    received_at timestamp with time zone DEFAULT now() NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    retry_at timestamp with time zone
);
ALTER TABLE hipq_early_reply ADD CONSTRAINT hipq_early_reply_pkey PRIMARY KEY (id);
CREATE INDEX hipq_early_reply_job_id ON hipq_early_reply USING btree (job_id) WHERE (job_id IS NOT NULL);
CREATE INDEX hipq_early_reply_key ON hipq_early_reply USING btree (job_type, job_key);

CREATE TABLE hipq_intake (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    value text NOT NULL,
    headers jsonb,
    created_at timestamp with time zone DEFAULT now() NOT NULL
);
ALTER TABLE hipq_intake SET (autovacuum_vacuum_insert_scale_factor=0, autovacuum_vacuum_insert_threshold=1000, autovacuum_vacuum_scale_factor=0, autovacuum_vacuum_threshold=1000);
ALTER TABLE hipq_intake ADD CONSTRAINT hipq_intake_pkey PRIMARY KEY (id);
CREATE TRIGGER hipq_intake_notify AFTER INSERT ON hipq_intake FOR EACH STATEMENT EXECUTE FUNCTION hipq_intake_notify();

CREATE TABLE hipq_job (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    queue text NOT NULL,
    job_type text NOT NULL,
    job_key text NOT NULL,
    job_data jsonb DEFAULT 'null'::jsonb NOT NULL,
    state text DEFAULT 'initial'::text NOT NULL,
    outcome text,
    error text DEFAULT 'NONE'::text NOT NULL,
    attempt integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 1 NOT NULL,
    scheduled_run_time timestamp with time zone DEFAULT now() NOT NULL,
    priority integer DEFAULT 100 NOT NULL,
    throttle_factor integer DEFAULT 1 NOT NULL,
    time_windows jsonb,
    timeout_seconds integer DEFAULT 86400 NOT NULL,
    expires_at timestamp with time zone,
    started_at timestamp with time zone,
    result jsonb,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    update_time timestamp with time zone DEFAULT now() NOT NULL,
    trace_parent text,
    trace_state text
);
ALTER TABLE hipq_job ADD CONSTRAINT hipq_job_attempt_check CHECK (attempt >= 0);
ALTER TABLE hipq_job ADD CONSTRAINT hipq_job_check CHECK ((state = 'final'::text) = (outcome IS NOT NULL));
ALTER TABLE hipq_job ADD CONSTRAINT hipq_job_check1 CHECK (attempt <= max_attempts);
ALTER TABLE hipq_job ADD CONSTRAINT hipq_job_max_attempts_check CHECK (max_attempts >= 1);
ALTER TABLE hipq_job ADD CONSTRAINT hipq_job_outcome_check CHECK (outcome = ANY (ARRAY['succeeded'::text, 'failed'::text, 'timed_out'::text, 'expired'::text, 'cancelled'::text]));
ALTER TABLE hipq_job ADD CONSTRAINT hipq_job_pkey PRIMARY KEY (id);
ALTER TABLE hipq_job ADD CONSTRAINT hipq_job_state_check CHECK (state = ANY (ARRAY['initial'::text, 'running'::text, 'error'::text, 'retry'::text, 'final'::text]));
ALTER TABLE hipq_job ADD CONSTRAINT hipq_job_throttle_factor_check CHECK (throttle_factor >= 1);
ALTER TABLE hipq_job ADD CONSTRAINT hipq_job_timeout_seconds_check CHECK (timeout_seconds > 0);
CREATE UNIQUE INDEX hipq_job_active_key ON hipq_job USING btree (job_type, job_key) WHERE (state <> 'final'::text);
CREATE INDEX hipq_job_due_type_prio ON hipq_job USING btree (queue, job_type, priority, scheduled_run_time, id) WHERE (state = ANY (ARRAY['initial'::text, 'retry'::text]));
CREATE INDEX hipq_job_due_type_sched ON hipq_job USING btree (queue, job_type, scheduled_run_time, priority, id) WHERE (state = ANY (ARRAY['initial'::text, 'retry'::text]));
CREATE INDEX hipq_job_expiring ON hipq_job USING btree (expires_at) WHERE ((state = ANY (ARRAY['initial'::text, 'retry'::text])) AND (expires_at IS NOT NULL));
CREATE INDEX hipq_job_final ON hipq_job USING btree (update_time) WHERE (state = 'final'::text);
CREATE INDEX hipq_job_final_key ON hipq_job USING btree (job_type, job_key, id) WHERE (state = 'final'::text);
CREATE INDEX hipq_job_running_timeout ON hipq_job USING btree (queue, timeout_seconds, started_at) WHERE (state = 'running'::text);

CREATE TABLE hipq_offset (
    consumer_group text NOT NULL,
    topic text NOT NULL,
    kafka_partition integer NOT NULL,
    next_offset bigint NOT NULL
);
ALTER TABLE hipq_offset ADD CONSTRAINT hipq_offset_pkey PRIMARY KEY (consumer_group, topic, kafka_partition);

CREATE TABLE hipq_queue (
    name text NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);
ALTER TABLE hipq_queue ADD CONSTRAINT hipq_queue_pkey PRIMARY KEY (name);

CREATE TABLE hipq_rate_count (
    rate text NOT NULL,
    part text NOT NULL,
    n integer NOT NULL
);
ALTER TABLE hipq_rate_count ADD CONSTRAINT hipq_rate_count_pkey PRIMARY KEY (rate, part);

CREATE TABLE hipq_rate_giveback (
    queue text NOT NULL,
    job_id bigint NOT NULL,
    attempt integer NOT NULL,
    claimed_at timestamp with time zone NOT NULL
);
ALTER TABLE hipq_rate_giveback ADD CONSTRAINT hipq_rate_giveback_pkey PRIMARY KEY (queue, job_id, attempt, claimed_at);

CREATE TABLE hipq_rate_unit (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    rate text NOT NULL,
    part text NOT NULL,
    job_ids bigint[] NOT NULL,
    attempts integer[] NOT NULL,
    n integer NOT NULL,
    at timestamp with time zone,
    queue text,
    claimed_at timestamp with time zone
);
ALTER TABLE hipq_rate_unit ADD CONSTRAINT hipq_rate_unit_pkey PRIMARY KEY (id);
CREATE INDEX hipq_rate_unit_claim ON hipq_rate_unit USING btree (queue, claimed_at) WHERE (at IS NULL);
CREATE INDEX hipq_rate_unit_window ON hipq_rate_unit USING btree (rate, at);

CREATE TABLE hipq_schedule (
    name text NOT NULL,
    last_fire timestamp with time zone NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    last_job_type text,
    last_job_key text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    update_time timestamp with time zone DEFAULT now() NOT NULL
);
ALTER TABLE hipq_schedule ADD CONSTRAINT hipq_schedule_pkey PRIMARY KEY (name);

CREATE TABLE hipq_schema_migration (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);
ALTER TABLE hipq_schema_migration ADD CONSTRAINT hipq_schema_migration_pkey PRIMARY KEY (version);

CREATE TABLE hipq_schema_repeatable (
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);
ALTER TABLE hipq_schema_repeatable ADD CONSTRAINT hipq_schema_repeatable_pkey PRIMARY KEY (name);

CREATE TABLE hipq_ui_session (
    id_hash bytea NOT NULL,
    token_hash bytea NOT NULL,
    role text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    expires_at timestamp with time zone NOT NULL
);
ALTER TABLE hipq_ui_session ADD CONSTRAINT hipq_ui_session_pkey PRIMARY KEY (id_hash);
ALTER TABLE hipq_ui_session ADD CONSTRAINT hipq_ui_session_role_check CHECK (role = ANY (ARRAY['admin'::text, 'read'::text]));
CREATE INDEX hipq_ui_session_expires ON hipq_ui_session USING btree (expires_at);

CREATE SEQUENCE hipq_dead_letter_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_dead_letter.id
CREATE SEQUENCE hipq_early_reply_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_early_reply.id
CREATE SEQUENCE hipq_intake_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_intake.id
CREATE SEQUENCE hipq_job_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_job.id
CREATE SEQUENCE hipq_rate_unit_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_rate_unit.id

CREATE OR REPLACE FUNCTION hipq_claim(p_queue text, p_order text, p_batch integer, p_instance text, p_types text[], p_type_windows jsonb, p_limit integer, p_critical text[], p_max_concurrency jsonb, p_share_path text[], p_share_caps jsonb, p_share_other_cap integer, p_rates jsonb)
 RETURNS TABLE(claimed boolean, id bigint, job_type text, job_key text, job_data jsonb, state text, attempt integer, max_attempts integer, timeout_seconds integer, expires_at timestamp with time zone, time_windows jsonb, started_at timestamp with time zone)
 LANGUAGE plpgsql
 SET enable_sort TO 'off'
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    v_bounded  boolean := p_limit >= 1 OR coalesce(p_max_concurrency, '{}') <> '{}' OR p_rates IS NOT NULL;
    -- Limits that skip jobs in the walk read more candidates than the
    -- batch; rates alone do not need to (a walk that fills a window scans
    -- again without it).
    v_overfetch boolean := p_limit >= 1 OR coalesce(p_max_concurrency, '{}') <> '{}' OR p_share_path IS NOT NULL;
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
    i int; t int; p int; k int;
    r record;
    -- rates: by index k, their key, limit, period, type and path; the used
    -- count of each (k, part) is v_uused at array_position(v_ukey, k || chr(31) || part)
    v_nr       int := 0;
    v_rkey     text[] := '{}';
    v_rlimit   int[] := '{}';
    v_rsecs    float8[] := '{}';
    v_rtype    text[] := '{}';
    v_rpath    jsonb[] := '{}';
    v_ukey     text[] := '{}';
    v_uused    int[] := '{}';
    v_parts_sql text := 'ARRAY['''']::text[]';
    v_rate_sql  text;
    v_full     text[];
    c_parts    text[][];  -- by candidate, the part of each rate
    v_ok       boolean;
    v_pass     int := 0;
    v_filled   boolean;
    v_got      int;
    v_wake     timestamptz;
    v_windows  jsonb := coalesce(p_type_windows, '{}');
    v_tids     tid[];
    v_open     boolean[];
    v_states   text[];
    v_atts     int[];
    v_types    text[];   -- the types whose due jobs are read
    v_sql      text;
    v_zr       text[];   -- windows whose count fell to 0
    v_zp       text[];
    v_ctids    tid[];
    v_want     int;
    v_skip     bigint[] := '{}';
    v_rate_out text[];   -- types whose whole rate window is full
BEGIN
    IF EXISTS (SELECT 1 FROM hipq_queue q WHERE q.name = p_queue AND q.paused) THEN
        RETURN;
    END IF;
    -- The types asked for, or else every type with a waiting job in the
    -- queue: a skip scan of the due index, one probe per type. Due jobs
    -- are read type by type (the due indexes lead with the type), so a
    -- backlog of a type this claim does not take is never walked.
    IF p_types IS NOT NULL THEN
        v_types := p_types;
    ELSE
        WITH RECURSIVE t(job_type) AS (
            (SELECT j.job_type FROM hipq_job j WHERE j.queue = p_queue AND j.state IN ('initial', 'retry')
             ORDER BY j.job_type LIMIT 1)
            UNION ALL
            SELECT (SELECT j.job_type FROM hipq_job j WHERE j.queue = p_queue AND j.state IN ('initial', 'retry')
                      AND j.job_type > t.job_type ORDER BY j.job_type LIMIT 1)
            FROM t WHERE t.job_type IS NOT NULL
        )
        SELECT coalesce(array_agg(t.job_type) FILTER (WHERE t.job_type IS NOT NULL), '{}') INTO v_types FROM t;
    END IF;
    IF cardinality(v_types) > 1 THEN
        -- Of several types, those with a due job now (one probe of each
        -- type's range of the due index): only they are read further.
        v_types := ARRAY(SELECT t.t FROM unnest(v_types) AS t(t)
                         WHERE (SELECT j.id FROM hipq_job j
                                WHERE j.queue = p_queue AND j.job_type = t.t AND j.state IN ('initial', 'retry')
                                  AND j.scheduled_run_time <= now() AND (j.expires_at IS NULL OR j.expires_at > now())
                                ORDER BY j.scheduled_run_time LIMIT 1) IS NOT NULL);
    END IF;
    IF cardinality(v_types) = 0 THEN
        RETURN;
    END IF;

    -- A queue with no limit (no throttle, cap or rate) takes the first
    -- due jobs in its order, locking them (SKIP LOCKED keeps concurrent
    -- dispatchers off each other's rows), in one statement: the locked
    -- rows are updated by their tuple ids, no walk of candidates in
    -- PL/pgSQL. Two texts, one per order, so each keeps its cached plan.
    IF NOT v_bounded AND p_share_path IS NULL THEN
        -- The first due jobs in the queue's order, locked (SKIP LOCKED
        -- keeps concurrent dispatchers off each other's rows): their tuple
        -- ids, the versions locked. One type (most claims): two texts, one
        -- per order, each with its cached plan, reading the type's due
        -- index.
        IF cardinality(v_types) > 1 THEN
            -- Several types: each type's first due jobs, read from its due
            -- index in the queue's order and merged in that order (a Merge
            -- Append, which reads each type only as far as the merge takes
            -- it); then those still waiting are locked, passing over rows
            -- another claim holds (SKIP LOCKED), and the merge is read
            -- again past them until the batch is full or nothing is left
            -- (at most 8 times). (Rows locked inside each type's read would
            -- keep the merge from being a Merge Append: every type would
            -- lock a whole batch.)
            v_sql := format($q$SELECT array_agg(s.id ORDER BY %1$s), array_agg(s.tid ORDER BY %1$s) FROM (%2$s ORDER BY %1$s LIMIT $2) s$q$,
                v_order,
                (SELECT string_agg(format($b$SELECT * FROM (
                            SELECT j.ctid AS tid, j.scheduled_run_time, j.priority, j.id
                            FROM hipq_job j
                            WHERE j.queue = $1 AND j.job_type = %L AND j.state IN ('initial', 'retry')
                              AND j.scheduled_run_time <= now() AND (j.expires_at IS NULL OR j.expires_at > now())
                              AND NOT j.id = ANY($3)
                            ORDER BY %s LIMIT $2) b$b$, t.t, v_order), ' UNION ALL ')
                 FROM unnest(v_types) AS t(t)));
            v_tids := '{}';
            v_open := '{}';
            v_states := '{}';
            v_atts := '{}';
            FOR i IN 1 .. 8 LOOP
                v_want := p_batch - cardinality(v_tids);
                EXECUTE v_sql INTO c_id, v_ctids USING p_queue, v_want, v_skip;
                EXIT WHEN c_id IS NULL;
                SELECT v_tids || coalesce(array_agg(l.tid ORDER BY l.ord), '{}'), v_open || coalesce(array_agg(l.open ORDER BY l.ord), '{}'),
                       v_states || coalesce(array_agg(l.state ORDER BY l.ord), '{}'), v_atts || coalesce(array_agg(l.attempt ORDER BY l.ord), '{}')
                  INTO v_tids, v_open, v_states, v_atts
                  FROM (SELECT j.ctid AS tid, j.state, j.attempt, c.ord,
                               CASE WHEN j.time_windows IS NULL AND NOT v_windows ? j.job_type THEN true
                                    ELSE hipq_window_open(coalesce(j.time_windows, v_windows -> j.job_type), now()) END AS open
                        FROM unnest(v_ctids, c_id) WITH ORDINALITY AS c(tid, id, ord)
                        JOIN hipq_job j ON j.ctid = c.tid
                        WHERE j.queue = p_queue AND j.id = c.id AND j.state IN ('initial', 'retry')
                          AND j.scheduled_run_time <= now() AND (j.expires_at IS NULL OR j.expires_at > now())
                        FOR UPDATE OF j SKIP LOCKED) l;
                v_skip := v_skip || c_id;
                EXIT WHEN cardinality(v_tids) >= p_batch OR cardinality(c_id) < v_want;
            END LOOP;
        ELSIF p_order = 'priority_first' THEN
            SELECT coalesce(array_agg(s.tid ORDER BY s.priority, s.scheduled_run_time, s.id), '{}'), coalesce(array_agg(s.open ORDER BY s.priority, s.scheduled_run_time, s.id), '{}'),
                   coalesce(array_agg(s.state ORDER BY s.priority, s.scheduled_run_time, s.id), '{}'), coalesce(array_agg(s.attempt ORDER BY s.priority, s.scheduled_run_time, s.id), '{}')
              INTO v_tids, v_open, v_states, v_atts
              FROM (SELECT j.ctid AS tid, j.state, j.attempt, j.scheduled_run_time, j.priority, j.id,
                           CASE WHEN j.time_windows IS NULL AND NOT v_windows ? j.job_type THEN true
                                ELSE hipq_window_open(coalesce(j.time_windows, v_windows -> j.job_type), now()) END AS open
                    FROM hipq_job j
                    WHERE j.queue = p_queue AND j.state IN ('initial', 'retry') AND j.scheduled_run_time <= now()
                      AND (j.expires_at IS NULL OR j.expires_at > now())
                      AND j.job_type = v_types[1]
                    ORDER BY j.priority, j.scheduled_run_time, j.id
                    LIMIT p_batch
                    FOR UPDATE OF j SKIP LOCKED) s;
        ELSE
            SELECT coalesce(array_agg(s.tid ORDER BY s.scheduled_run_time, s.priority, s.id), '{}'), coalesce(array_agg(s.open ORDER BY s.scheduled_run_time, s.priority, s.id), '{}'),
                   coalesce(array_agg(s.state ORDER BY s.scheduled_run_time, s.priority, s.id), '{}'), coalesce(array_agg(s.attempt ORDER BY s.scheduled_run_time, s.priority, s.id), '{}')
              INTO v_tids, v_open, v_states, v_atts
              FROM (SELECT j.ctid AS tid, j.state, j.attempt, j.scheduled_run_time, j.priority, j.id,
                           CASE WHEN j.time_windows IS NULL AND NOT v_windows ? j.job_type THEN true
                                ELSE hipq_window_open(coalesce(j.time_windows, v_windows -> j.job_type), now()) END AS open
                    FROM hipq_job j
                    WHERE j.queue = p_queue AND j.state IN ('initial', 'retry') AND j.scheduled_run_time <= now()
                      AND (j.expires_at IS NULL OR j.expires_at > now())
                      AND j.job_type = v_types[1]
                    ORDER BY j.scheduled_run_time, j.priority, j.id
                    LIMIT p_batch
                    FOR UPDATE OF j SKIP LOCKED) s;
        END IF;
        -- A statement of its own, so its snapshot sees the versions locked
        -- (one committed after the first statement began is locked there
        -- but invisible to that statement): each is updated by its tuple
        -- id, guarded by the state and attempt it was locked in (compared
        -- with the locked values, not constants, so no partial index of
        -- due jobs is ever walked instead).
        RETURN QUERY
        WITH c AS (
            SELECT * FROM unnest(v_tids, v_open, v_states, v_atts) WITH ORDINALITY AS c(tid, open, state, attempt, ord)
        ), moved AS (
            UPDATE hipq_job j
            SET state = 'running', attempt = j.attempt + 1, started_at = now(), update_time = now(), error = 'NONE'
            FROM c
            WHERE j.ctid = c.tid AND c.open AND j.queue = p_queue AND j.state = c.state AND j.attempt = c.attempt
            RETURNING j.id, j.job_type, j.job_key, j.job_data, j.state, j.attempt, j.max_attempts,
                      j.timeout_seconds, j.expires_at, j.time_windows, j.started_at, c.ord
        ), att AS (
            INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at)
            SELECT p_queue, m.id, m.attempt, p_instance, m.started_at FROM moved m
        )
        SELECT * FROM (
            SELECT true, m.id, m.job_type, m.job_key, m.job_data, m.state, m.attempt, m.max_attempts,
                   m.timeout_seconds, m.expires_at, m.time_windows, m.started_at
            FROM moved m ORDER BY m.ord
        ) x
        UNION ALL
        SELECT false, j.id, j.job_type, j.job_key, NULL::jsonb, j.state, j.attempt, j.max_attempts,
               j.timeout_seconds, j.expires_at, j.time_windows, j.started_at
        FROM c JOIN hipq_job j ON j.ctid = c.tid
        WHERE NOT c.open AND j.queue = p_queue;
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
        IF p_limit >= 1 THEN  -- (a queue bounded only by rates or caps sums nothing)
            SELECT coalesce(sum(j.throttle_factor) FILTER (WHERE NOT j.job_type = ANY(v_critical)), 0)
              INTO v_used
              FROM hipq_job j WHERE j.queue = p_queue AND j.state = 'running';
        END IF;
        IF v_used >= v_cap AND cardinality(v_critical) = 0 THEN
            RETURN;  -- full, and nothing here may pass a full queue
        END IF;
    END IF;

    IF p_rates IS NOT NULL THEN
        FOR r IN SELECT x.key, x."limit", x.secs, x.type, x.path FROM jsonb_to_recordset(p_rates)
                 AS x(key text, "limit" int, secs float8, type text, path jsonb) LOOP
            v_rkey := v_rkey || r.key;
            v_rlimit := v_rlimit || r."limit";
            v_rsecs := v_rsecs || r.secs;
            v_rtype := v_rtype || r.type;
            v_rpath := v_rpath || r.path;
        END LOOP;
        v_nr := cardinality(v_rkey);
        -- A unit is the requests of one claim (claimed_at: its started_at)
        -- under one window. Units not yet timed are settled here, under the
        -- lock, so no hot path pays for rates. A request counts while it
        -- may be in flight; then until period after the moment it may have
        -- arrived: its acknowledged send (sent_at), or now for an attempt
        -- that ended unsent or whose claim is gone (undone after a send in
        -- doubt, or its job gone): it may have left. Only a request known
        -- never to have left is given back: its undo left a row in
        -- hipq_rate_giveback, which is taken out of the unit here. An
        -- attempt row counts for a unit only when it is the unit's own
        -- claim's (a later claim reuses an undone claim's attempt number).
        -- A unit left with no request goes at once, and so does a window
        -- whose count falls to 0: what the claim reads is bounded by the
        -- windows that count.
        -- (Times are taken when the statement runs, after the lock was
        -- waited for: later than any end or undo it sees, never the
        -- transaction's start. A unit written before version 17 has no
        -- claim; its count is never raised.)
        WITH t AS (
            SELECT clock_timestamp() AS now
        ), m AS (
            SELECT u.id, u.n, u.claimed_at, x.id AS job_id, x.att, g.job_id IS NOT NULL AS back,
                   g.job_id IS NULL AND a.job_id IS NOT NULL AND a.sent_at IS NULL AND a.outcome IS NULL AS flying,
                   CASE WHEN g.job_id IS NOT NULL THEN NULL
                        WHEN a.job_id IS NULL THEN t.now
                        ELSE coalesce(a.sent_at, CASE WHEN a.outcome IS NOT NULL THEN t.now END) END AS at
            FROM t, hipq_rate_unit u
            CROSS JOIN LATERAL unnest(u.job_ids, u.attempts) AS x(id, att)
            LEFT JOIN hipq_attempt a ON a.queue = p_queue AND a.job_id = x.id AND a.attempt = x.att
                                     AND (u.claimed_at IS NULL OR a.dispatched_at = u.claimed_at)
            LEFT JOIN hipq_rate_giveback g ON g.queue = p_queue AND g.job_id = x.id AND g.attempt = x.att
                                           AND g.claimed_at = u.claimed_at
            WHERE u.rate = ANY(v_rkey) AND u.at IS NULL
        ), counted_m AS (
            SELECT m.id, m.n, m.claimed_at, (count(*) FILTER (WHERE NOT m.back))::int AS left_n, bool_or(m.flying) AS flying,
                   max(m.at) AS at,
                   coalesce(array_agg(m.job_id) FILTER (WHERE NOT m.back), '{}') AS ids,
                   coalesce(array_agg(m.att) FILTER (WHERE NOT m.back), '{}') AS atts
            FROM m GROUP BY m.id, m.n, m.claimed_at
        ), open AS (
            SELECT c.id, c.n, c.flying, c.at, c.ids, c.atts,
                   CASE WHEN c.claimed_at IS NULL THEN least(c.n, c.left_n) ELSE c.left_n END AS present
            FROM counted_m c
        ), taken AS (
            DELETE FROM hipq_rate_giveback g USING m
            WHERE m.back AND g.queue = p_queue AND g.job_id = m.job_id AND g.attempt = m.att AND g.claimed_at = m.claimed_at
        ), fixed AS (
            UPDATE hipq_rate_unit u
            SET n = o.present, job_ids = o.ids, attempts = o.atts,
                at = CASE WHEN o.present = 0 THEN '-infinity' WHEN o.flying THEN NULL ELSE coalesce(o.at, clock_timestamp()) END
            FROM open o
            WHERE u.id = o.id AND (o.present <> o.n OR NOT o.flying)
            RETURNING u.rate, u.part, o.n - o.present AS gone
        ), counted AS (
            UPDATE hipq_rate_count c SET n = c.n - g.n
            FROM (SELECT fixed.rate, fixed.part, sum(fixed.gone)::int AS n FROM fixed GROUP BY 1, 2) g
            WHERE c.rate = g.rate AND c.part = g.part AND g.n <> 0
            RETURNING c.rate, c.part, c.n
        )
        SELECT array_agg(counted.rate), array_agg(counted.part) INTO v_zr, v_zp FROM counted WHERE counted.n <= 0;
        DELETE FROM hipq_rate_count c USING unnest(v_zr, v_zp) AS z(rate, part)
        WHERE c.rate = z.rate AND c.part = z.part AND c.n <= 0;
        -- Units whose last request arrived more than a period ago go; the
        -- others count.
        WITH gone AS (
            DELETE FROM hipq_rate_unit u
            USING unnest(v_rkey, v_rsecs) AS q(key, secs)
            WHERE u.rate = q.key AND u.at <= now() - make_interval(secs => q.secs)
            RETURNING u.rate, u.part, u.n
        ), counted AS (
            UPDATE hipq_rate_count c SET n = c.n - g.n
            FROM (SELECT gone.rate, gone.part, sum(gone.n)::int AS n FROM gone GROUP BY 1, 2) g
            WHERE c.rate = g.rate AND c.part = g.part AND g.n <> 0
            RETURNING c.rate, c.part, c.n
        )
        SELECT array_agg(counted.rate), array_agg(counted.part) INTO v_zr, v_zp FROM counted WHERE counted.n <= 0;
        DELETE FROM hipq_rate_count c USING unnest(v_zr, v_zp) AS z(rate, part)
        WHERE c.rate = z.rate AND c.part = z.part AND c.n <= 0;
        -- Give-backs no unit waits for (their units were settled, or
        -- belong to a rate no longer configured).
        DELETE FROM hipq_rate_giveback g
        WHERE g.queue = p_queue
          AND NOT EXISTS (SELECT 1 FROM hipq_rate_unit u
                          WHERE u.queue = p_queue AND u.claimed_at = g.claimed_at AND u.at IS NULL);
        FOR r IN SELECT array_position(v_rkey, c.rate) AS k, c.part, c.n
                 FROM hipq_rate_count c WHERE c.rate = ANY(v_rkey) AND c.n > 0 LOOP
            v_ukey := v_ukey || (r.k || chr(31) || r.part);
            v_uused := v_uused || r.n;
        END LOOP;
        v_parts_sql := 'ARRAY[' || (SELECT string_agg(CASE WHEN v_rpath[k] IS NULL THEN ''''''
                                                         ELSE format('coalesce(j.job_data #>> %L::text[], '''')',
                                                                     ARRAY(SELECT jsonb_array_elements_text(v_rpath[k]))) END, ', ')
                                    FROM generate_series(1, v_nr) k) || ']::text[]';
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
    -- left, a full rate window) is filtered out here, so it never crowds
    -- the scan. When rate windows fill during a walk, the scan is made
    -- again without them (at most 8 passes).
    LOOP
    v_pass := v_pass + 1;
    v_rate_sql := '';
    v_rate_out := '{}';
    FOR k IN 1 .. v_nr LOOP
        -- (a key is k, chr(31), then the part, which may hold any character)
        v_full := ARRAY(SELECT substr(u, strpos(u, chr(31)) + 1) FROM unnest(v_ukey, v_uused) AS x(u, n)
                        WHERE split_part(u, chr(31), 1) = k::text AND n >= v_rlimit[k]);
        IF cardinality(v_full) = 0 THEN
            CONTINUE;
        END IF;
        IF v_rpath[k] IS NULL AND v_rtype[k] IS NULL THEN
            v_rate_out := v_types;  -- the queue's own window is full: no type is read
        ELSIF v_rpath[k] IS NULL THEN
            v_rate_out := v_rate_out || v_rtype[k];  -- the type's window is full: the type is not read
        ELSE
            v_rate_sql := v_rate_sql || format(' AND NOT (%s coalesce(j.job_data #>> %L::text[], '''') = ANY(%L::text[]))',
                CASE WHEN v_rtype[k] IS NULL THEN '' ELSE format('j.job_type = %L AND', v_rtype[k]) END,
                ARRAY(SELECT jsonb_array_elements_text(v_rpath[k])), v_full);
        END IF;
    END LOOP;
    c_id := '{}';
    -- Each type's first candidates from its due index, merged in the
    -- queue's order; full types are not read at all.
    v_sql := (SELECT string_agg(format($b$SELECT * FROM (
            SELECT j.id, j.state, j.attempt, j.throttle_factor, j.job_type, j.scheduled_run_time, j.priority,
                   %s AS rparts,
                   CASE WHEN $5::text[] IS NULL THEN NULL
                        WHEN $9 ? (j.job_data #>> $5) THEN j.job_data #>> $5 ELSE '*' END AS part,
                   CASE WHEN j.time_windows IS NULL AND NOT $3 ? j.job_type THEN true
                        ELSE hipq_window_open(coalesce(j.time_windows, $3 -> j.job_type), now()) END AS open
            FROM hipq_job j
            WHERE j.queue = $1 AND j.job_type = %L AND j.state IN ('initial', 'retry') AND j.scheduled_run_time <= now()
              AND (j.expires_at IS NULL OR j.expires_at > now())
              AND (j.job_type = ANY($4) OR (
                    j.throttle_factor <= $6
                    AND ($5::text[] IS NULL OR NOT CASE WHEN $9 ? (j.job_data #>> $5)
                                                        THEN (j.job_data #>> $5) = ANY($8)
                                                        ELSE $10 END)))
              AND NOT j.id = ANY($12)
              %s
            ORDER BY %s
            LIMIT $11
            %s) b$b$, v_parts_sql, t.t, v_rate_sql, v_order, CASE WHEN v_bounded THEN '' ELSE 'FOR UPDATE SKIP LOCKED' END),
            ' UNION ALL ')
        FROM unnest(v_types) AS t(t) WHERE NOT t.t = ANY(v_full_type) AND NOT t.t = ANY(v_rate_out));
    IF v_sql IS NOT NULL THEN
        EXECUTE format($q$
            SELECT coalesce(array_agg(c.id), '{}'), array_agg(c.state), array_agg(c.attempt), array_agg(c.throttle_factor),
                   array_agg(c.job_type), array_agg(c.part), array_agg(c.open), array_agg(c.rparts)
            FROM (%s ORDER BY %s LIMIT $11) c$q$, v_sql, v_order)
            INTO c_id, c_state, c_att, c_factor, c_type, c_part, c_open, c_parts
            USING p_queue, NULL::text[], coalesce(p_type_windows, '{}'), v_critical, p_share_path, v_cap - v_used,
                  v_full_type, coalesce(v_full_part, '{}'), coalesce(p_share_caps, '{}'), v_other_full,
                  CASE WHEN v_overfetch THEN greatest(p_batch * 4, 1000) ELSE p_batch END, v_pick || v_out;
    END IF;
    v_got := cardinality(c_id);
    v_filled := false;

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
        IF v_nr > 0 THEN
            v_ok := true;
            FOR k IN 1 .. v_nr LOOP
                CONTINUE WHEN v_rtype[k] IS NOT NULL AND v_rtype[k] <> c_type[i];
                p := array_position(v_ukey, k || chr(31) || c_parts[i][k]);
                IF p IS NOT NULL AND v_uused[p] >= v_rlimit[k] THEN
                    v_ok := false;
                    EXIT;
                END IF;
            END LOOP;
            CONTINUE WHEN NOT v_ok;
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
        FOR k IN 1 .. v_nr LOOP
            CONTINUE WHEN v_rtype[k] IS NOT NULL AND v_rtype[k] <> c_type[i];
            p := array_position(v_ukey, k || chr(31) || c_parts[i][k]);
            IF p IS NULL THEN
                v_ukey := v_ukey || (k || chr(31) || c_parts[i][k]);
                v_uused := v_uused || 1;
                p := cardinality(v_uused);
            ELSE
                v_uused[p] := v_uused[p] + 1;
            END IF;
            IF v_uused[p] >= v_rlimit[k] THEN
                v_filled := true;
            END IF;
        END LOOP;
        v_pick := v_pick || c_id[i];
        v_pick_st := v_pick_st || c_state[i];
        v_pick_att := v_pick_att || c_att[i];
        EXIT WHEN cardinality(v_pick) >= p_batch;
        EXIT WHEN v_used >= v_cap AND cardinality(v_critical) = 0;
    END LOOP;
    -- Again without the windows this walk filled, while the scan may have
    -- left candidates behind them.
    EXIT WHEN NOT v_filled OR v_pass >= 8 OR cardinality(v_pick) >= p_batch
              OR v_got < CASE WHEN v_overfetch THEN greatest(p_batch * 4, 1000) ELSE p_batch END
              OR (v_used >= v_cap AND cardinality(v_critical) = 0);
    END LOOP;

    IF v_nr > 0 THEN
        -- When the earliest full window frees: a unit counting least long.
        SELECT min(u.at + make_interval(secs => v_rsecs[x.k])) INTO v_wake
        FROM unnest(v_ukey, v_uused) AS f(u, n)
        CROSS JOIN LATERAL (SELECT split_part(f.u, chr(31), 1)::int AS k, substr(f.u, strpos(f.u, chr(31)) + 1) AS part) x
        JOIN hipq_rate_unit u ON u.rate = v_rkey[x.k] AND u.part = x.part
        WHERE f.n >= v_rlimit[x.k] AND u.at IS NOT NULL;
        IF v_wake IS NOT NULL THEN
            RETURN QUERY SELECT NULL::boolean, 0::bigint, ''::text, ''::text, NULL::jsonb, ''::text, 0,
                                0, 0, NULL::timestamptz, NULL::jsonb, v_wake;
        END IF;
    END IF;

    RETURN QUERY
    WITH pick AS (
        SELECT * FROM unnest(v_pick, v_pick_st, v_pick_att) WITH ORDINALITY AS p(id, state, attempt, ord)
    ), moved AS (
        UPDATE hipq_job j
        SET state = 'running', attempt = j.attempt + 1, started_at = now(), update_time = now(), error = 'NONE'
        FROM pick
        WHERE j.queue = p_queue AND j.id = pick.id AND j.state = pick.state AND j.attempt = pick.attempt
        RETURNING j.id, j.job_type, j.job_key, j.job_data, j.state, j.attempt, j.max_attempts,
                  j.timeout_seconds, j.expires_at, j.time_windows, j.started_at, pick.ord
    ), att AS (
        INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at)
        SELECT p_queue, m.id, m.attempt, p_instance, m.started_at FROM moved m
    ), units AS (
        INSERT INTO hipq_rate_unit (queue, claimed_at, rate, part, job_ids, attempts, n)
        SELECT p_queue, now(), w.key, w.part, array_agg(w.id), array_agg(w.attempt), count(*)
        FROM (SELECT x.key, m.id, m.attempt,
                     CASE WHEN x.path IS NULL THEN ''
                          ELSE coalesce(m.job_data #>> ARRAY(SELECT jsonb_array_elements_text(x.path)), '') END AS part
              FROM moved m
              JOIN jsonb_to_recordset(coalesce(p_rates, '[]')) AS x(key text, type text, path jsonb)
                ON x.type IS NULL OR x.type = m.job_type) w
        GROUP BY w.key, w.part
        RETURNING rate, part, n
    ), counts AS (
        INSERT INTO hipq_rate_count (rate, part, n)
        SELECT units.rate, units.part, sum(units.n) FROM units GROUP BY 1, 2
        ON CONFLICT (rate, part) DO UPDATE SET n = hipq_rate_count.n + EXCLUDED.n
    )
    SELECT * FROM (
        SELECT true, m.id, m.job_type, m.job_key, m.job_data, m.state, m.attempt, m.max_attempts,
               m.timeout_seconds, m.expires_at, m.time_windows, m.started_at
        FROM moved m ORDER BY m.ord
    ) c
    UNION ALL
    SELECT false, j.id, j.job_type, j.job_key, NULL::jsonb, j.state, j.attempt, j.max_attempts,
           j.timeout_seconds, j.expires_at, j.time_windows, j.started_at
    FROM hipq_job j WHERE j.queue = p_queue AND j.id = ANY(v_out);
END $function$;

CREATE OR REPLACE FUNCTION hipq_intake_notify()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM pg_notify('hipq_intake', '');
    RETURN NULL;
END $function$;

CREATE OR REPLACE FUNCTION hipq_window_open(windows jsonb, t timestamp with time zone)
 RETURNS boolean
 LANGUAGE plpgsql
 STABLE
AS $function$
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
END $function$;

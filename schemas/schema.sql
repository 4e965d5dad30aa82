-- hipq's schema at version 27, with its repeatable migrations applied, as
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

CREATE TABLE hipq_claim_lock (
    queue text NOT NULL,
    claimed_at timestamp with time zone NOT NULL
);
ALTER TABLE hipq_claim_lock ADD CONSTRAINT hipq_claim_lock_pkey PRIMARY KEY (queue);

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
    retry_at timestamp with time zone,
    queue text
);
ALTER TABLE hipq_early_reply ADD CONSTRAINT hipq_early_reply_pkey PRIMARY KEY (id);
CREATE INDEX hipq_early_reply_job_id ON hipq_early_reply USING btree (job_id) WHERE (job_id IS NOT NULL);
CREATE INDEX hipq_early_reply_key ON hipq_early_reply USING btree (job_type, job_key);

CREATE TABLE hipq_event (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    queue text NOT NULL,
    topic text NOT NULL,
    job_id bigint NOT NULL,
    job_type text NOT NULL,
    job_key text NOT NULL,
    attempt integer NOT NULL,
    outcome text NOT NULL,
    trace_parent text,
    headers jsonb,
    value jsonb,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    state text,
    result jsonb,
    error text,
    job_created_at timestamp with time zone,
    finished_at timestamp with time zone
);
ALTER TABLE hipq_event SET (autovacuum_vacuum_insert_scale_factor=0, autovacuum_vacuum_insert_threshold=1000, autovacuum_vacuum_scale_factor=0, autovacuum_vacuum_threshold=1000);
ALTER TABLE hipq_event ADD CONSTRAINT hipq_event_pkey PRIMARY KEY (id);
CREATE INDEX hipq_event_topic ON hipq_event USING btree (topic, id);
CREATE TRIGGER hipq_event_notify AFTER INSERT ON hipq_event REFERENCING NEW TABLE AS hipq_event_new FOR EACH STATEMENT EXECUTE FUNCTION hipq_event_notify();

CREATE TABLE hipq_event_cursor (
    topic text NOT NULL,
    after bigint NOT NULL,
    update_time timestamp with time zone DEFAULT now() NOT NULL
);
ALTER TABLE hipq_event_cursor ADD CONSTRAINT hipq_event_cursor_pkey PRIMARY KEY (topic);

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
    trace_state text,
    reply_to text,
    correlation jsonb,
    event_topic text,
    event_id bigint
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
CREATE INDEX hipq_job_event ON hipq_job USING btree (event_topic, event_id) WHERE (event_id IS NOT NULL);
CREATE INDEX hipq_job_expiring ON hipq_job USING btree (expires_at) WHERE ((state = ANY (ARRAY['initial'::text, 'retry'::text])) AND (expires_at IS NOT NULL));
CREATE INDEX hipq_job_final ON hipq_job USING btree (update_time) WHERE (state = 'final'::text);
CREATE INDEX hipq_job_final_key ON hipq_job USING btree (job_type, job_key, id) WHERE (state = 'final'::text);
CREATE INDEX hipq_job_running_timeout ON hipq_job USING btree (queue, timeout_seconds, started_at) WHERE (state = 'running'::text);

CREATE TABLE hipq_lock (
    name text NOT NULL,
    holder text NOT NULL,
    until timestamp with time zone NOT NULL
);
ALTER TABLE hipq_lock ADD CONSTRAINT hipq_lock_pkey PRIMARY KEY (name);

CREATE TABLE hipq_offset (
    consumer_group text NOT NULL,
    topic text NOT NULL,
    kafka_partition integer NOT NULL,
    next_offset bigint NOT NULL
);
ALTER TABLE hipq_offset ADD CONSTRAINT hipq_offset_pkey PRIMARY KEY (consumer_group, topic, kafka_partition);

CREATE TABLE hipq_operation (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    kind text NOT NULL,
    filter jsonb NOT NULL,
    reason text NOT NULL,
    token_name text NOT NULL,
    state text DEFAULT 'running'::text NOT NULL,
    matched bigint DEFAULT 0 NOT NULL,
    done bigint DEFAULT 0 NOT NULL,
    skipped bigint DEFAULT 0 NOT NULL,
    cursor_id bigint DEFAULT 0 NOT NULL,
    until_id bigint NOT NULL,
    owner text,
    lease_until timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);
ALTER TABLE hipq_operation ADD CONSTRAINT hipq_operation_check CHECK (matched = (done + skipped));
ALTER TABLE hipq_operation ADD CONSTRAINT hipq_operation_check1 CHECK (state = 'running'::text OR owner IS NULL);
ALTER TABLE hipq_operation ADD CONSTRAINT hipq_operation_kind_check CHECK (kind = ANY (ARRAY['jobs.cancel'::text, 'jobs.replay'::text, 'jobs.run_now'::text, 'dead_letters.replay'::text]));
ALTER TABLE hipq_operation ADD CONSTRAINT hipq_operation_pkey PRIMARY KEY (id);
ALTER TABLE hipq_operation ADD CONSTRAINT hipq_operation_reason_check CHECK (reason <> ''::text);
ALTER TABLE hipq_operation ADD CONSTRAINT hipq_operation_state_check CHECK (state = ANY (ARRAY['running'::text, 'done'::text, 'stopped'::text]));
CREATE INDEX hipq_operation_running ON hipq_operation USING btree (id) WHERE (state = 'running'::text);

CREATE TABLE hipq_queue (
    name text NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);
ALTER TABLE hipq_queue ADD CONSTRAINT hipq_queue_pkey PRIMARY KEY (name);

CREATE TABLE hipq_rate_count (
    rate text NOT NULL,
    part text NOT NULL,
    n integer NOT NULL,
    queue text
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
CREATE SEQUENCE hipq_event_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_event.id
CREATE SEQUENCE hipq_intake_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_intake.id
CREATE SEQUENCE hipq_job_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_job.id
CREATE SEQUENCE hipq_operation_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_operation.id
CREATE SEQUENCE hipq_rate_unit_id_seq AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1; -- owned by hipq_rate_unit.id

CREATE OR REPLACE FUNCTION hipq_event_notify()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    topics text;
BEGIN
    SELECT string_agg(DISTINCT topic, ',' ORDER BY topic) INTO topics FROM hipq_event_new;
    IF topics IS NOT NULL THEN
        PERFORM pg_notify('hipq_event', CASE WHEN octet_length(topics) < 7000 THEN topics ELSE '' END);
    END IF;
    RETURN NULL;
END $function$;

CREATE OR REPLACE FUNCTION hipq_intake_notify()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM pg_notify('hipq_intake', '');
    RETURN NULL;
END $function$;

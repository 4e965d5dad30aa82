-- hipq schema, version 1. Operators read these tables with SQL (docs/tables.md).

CREATE TABLE hipq_job (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue              text        NOT NULL,
    job_type           text        NOT NULL,
    job_key            text        NOT NULL,
    job_data           jsonb       NOT NULL DEFAULT 'null',
    state              text        NOT NULL DEFAULT 'initial'
                       CHECK (state IN ('initial', 'running', 'error', 'retry', 'final')),
    outcome            text        CHECK (outcome IN ('succeeded', 'failed', 'timed_out', 'expired', 'cancelled')),
    error              text        NOT NULL DEFAULT 'NONE',
    attempt            int         NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts       int         NOT NULL DEFAULT 1 CHECK (max_attempts >= 1),
    scheduled_run_time timestamptz NOT NULL DEFAULT now(),
    priority           int         NOT NULL DEFAULT 100,
    throttle_factor    int         NOT NULL DEFAULT 1 CHECK (throttle_factor >= 1),
    time_windows       jsonb,
    timeout_seconds    int         NOT NULL DEFAULT 86400 CHECK (timeout_seconds > 0),
    expires_at         timestamptz,
    started_at         timestamptz,
    result             jsonb,
    created_at         timestamptz NOT NULL DEFAULT now(),
    update_time        timestamptz NOT NULL DEFAULT now(),
    CHECK ((state = 'final') = (outcome IS NOT NULL)),
    CHECK (attempt <= max_attempts)
);

-- Invariant 1: at most one non-final job per (job_type, job_key).
CREATE UNIQUE INDEX hipq_job_active_key ON hipq_job (job_type, job_key) WHERE state <> 'final';
-- Latest final job of a key (GET, duplicate replies).
CREATE INDEX hipq_job_key ON hipq_job (job_type, job_key, id);
-- Claim, in both queue orders; partial so final rows cost nothing.
CREATE INDEX hipq_job_due_sched ON hipq_job (queue, scheduled_run_time, priority, id) WHERE state IN ('initial', 'retry');
CREATE INDEX hipq_job_due_prio ON hipq_job (queue, priority, scheduled_run_time, id) WHERE state IN ('initial', 'retry');
-- Timeouts and throttle counts.
CREATE INDEX hipq_job_running ON hipq_job (queue, started_at) WHERE state = 'running';
-- Expiry of waiting jobs.
CREATE INDEX hipq_job_expiring ON hipq_job (expires_at) WHERE state IN ('initial', 'retry') AND expires_at IS NOT NULL;
-- Retention.
CREATE INDEX hipq_job_final ON hipq_job (update_time) WHERE state = 'final';

CREATE TABLE hipq_attempt (
    job_id        bigint      NOT NULL REFERENCES hipq_job (id) ON DELETE CASCADE,
    attempt       int         NOT NULL,
    instance      text        NOT NULL,
    dispatched_at timestamptz NOT NULL DEFAULT now(),
    sent_at       timestamptz,
    replied_at    timestamptz,
    outcome       text CHECK (outcome IN ('succeeded', 'failed', 'timed_out', 'dispatch_error', 'cancelled')),
    error         text,
    reply         jsonb,
    PRIMARY KEY (job_id, attempt)
);
-- Claims whose request never left (invariant 8).
CREATE INDEX hipq_attempt_unsent ON hipq_attempt (dispatched_at) WHERE sent_at IS NULL AND outcome IS NULL;

CREATE TABLE hipq_early_reply (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_type        text        NOT NULL,
    job_key         text        NOT NULL,
    job_id          bigint,
    attempt         int,
    success         boolean     NOT NULL,
    retryable       boolean     NOT NULL,
    error_text      text        NOT NULL DEFAULT '',
    reply           jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '[]',
    source          text        NOT NULL DEFAULT 'reply',
    topic           text,
    kafka_partition int,
    kafka_offset    bigint,
    record_key      bytea,
    record_value    bytea,
    received_at     timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL
);
CREATE INDEX hipq_early_reply_key ON hipq_early_reply (job_type, job_key);

CREATE TABLE hipq_dead_letter (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source          text        NOT NULL CHECK (source IN ('intake', 'reply', 'callback')),
    topic           text,
    kafka_partition int,
    kafka_offset    bigint,
    record_key      bytea,
    record_value    bytea,
    headers         jsonb       NOT NULL DEFAULT '[]',
    reason          text        NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    replayed_at     timestamptz
);
CREATE INDEX hipq_dead_letter_received ON hipq_dead_letter (received_at);

-- Consumed offsets (invariant 7): the next offset to read per group and
-- partition, written in the same transaction as the records' effects.
CREATE TABLE hipq_offset (
    consumer_group  text   NOT NULL,
    topic           text   NOT NULL,
    kafka_partition int    NOT NULL,
    next_offset     bigint NOT NULL,
    PRIMARY KEY (consumer_group, topic, kafka_partition)
);

-- Paused queues, honoured by every instance's dispatcher.
CREATE TABLE hipq_queue (
    name       text PRIMARY KEY,
    paused     boolean     NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- hipq schema, version 22: bulk operations. A cancel, replay or run-now of
-- every job a filter matches, or a replay of every dead letter one
-- matches, is a row here: what it does (kind), its filter as the API took
-- it (with the implicit bound on creation time filled in), why (reason)
-- and who asked (token_name, never the token), and how far it got. It
-- walks its table by id in batches; each batch moves cursor_id and the
-- counts in the same transaction as its effects, so an operation cut
-- short by a restart goes on from where it stopped and acts on no row
-- twice. until_id is the table's highest id when it was asked: rows
-- inserted later are never walked. One instance works an operation at a
-- time: owner holds it until lease_until, each batch moving that on, and
-- another instance takes over once it has passed. Safe to run again (IF
-- NOT EXISTS).
CREATE TABLE IF NOT EXISTS hipq_operation (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind        text        NOT NULL CHECK (kind IN ('jobs.cancel', 'jobs.replay', 'jobs.run_now', 'dead_letters.replay')),
    filter      jsonb       NOT NULL,
    reason      text        NOT NULL CHECK (reason <> ''),
    token_name  text        NOT NULL,
    state       text        NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'done', 'stopped')),
    matched     bigint      NOT NULL DEFAULT 0,
    done        bigint      NOT NULL DEFAULT 0,
    skipped     bigint      NOT NULL DEFAULT 0,
    cursor_id   bigint      NOT NULL DEFAULT 0,
    until_id    bigint      NOT NULL,
    owner       text,
    lease_until timestamptz,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CHECK (matched = done + skipped),
    CHECK ((state = 'running') OR (owner IS NULL))
);
-- The operations left to resume: few rows, read by every API instance.
CREATE INDEX IF NOT EXISTS hipq_operation_running ON hipq_operation (id) WHERE state = 'running';

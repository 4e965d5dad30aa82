-- hipq schema, version 17: rate units belong to one claim, and a request
-- that may have left keeps counting.
--
-- A unit (hipq_rate_unit) now names its queue and its claim (claimed_at,
-- the claim's started_at, which its attempt rows carry as dispatched_at):
-- an undone claim gives its attempt number back and the next claim of the
-- job takes it again, and that later claim's attempt row is not the unit's.
-- A request is given back only when its claim was undone because it never
-- left (the send refused or never started): that undo leaves a row in
-- hipq_rate_giveback, which the next claim of the queue takes out of the
-- unit. A request whose claim is gone any other way (undone after a send
-- in doubt, its job cancelled, expired or pruned) may have reached the
-- downstream and counts for a period from the claim that settles it.
-- Windows whose count falls to 0 are deleted as it falls, so what a claim
-- reads is bounded by the windows that count, not by every value ever
-- seen.
--
-- The claim that writes and reads these rows was then hipq_claim, a
-- repeatable migration; since version 20 it is the store's statements,
-- and the domain decides it.
ALTER TABLE hipq_rate_unit ADD COLUMN IF NOT EXISTS queue text;
ALTER TABLE hipq_rate_unit ADD COLUMN IF NOT EXISTS claimed_at timestamptz;
-- An undo finds whether its claim has units still counting by this.
CREATE INDEX IF NOT EXISTS hipq_rate_unit_claim ON hipq_rate_unit (queue, claimed_at) WHERE at IS NULL;

-- hipq_rate_giveback: requests of claims undone because they never left,
-- until the next claim of their queue takes them out of their units.
CREATE TABLE IF NOT EXISTS hipq_rate_giveback (
    queue      text        NOT NULL,
    job_id     bigint      NOT NULL,
    attempt    int         NOT NULL,
    claimed_at timestamptz NOT NULL,
    PRIMARY KEY (queue, job_id, attempt, claimed_at)
);

DELETE FROM hipq_rate_count WHERE n <= 0;

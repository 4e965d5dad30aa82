-- hipq schema, version 14: an early reply keeps its retry_after, as the
-- time before which its failure's retry may not run (a delay is counted
-- from the reply's arrival, on the database's clock). Adding a nullable
-- column rewrites nothing.
ALTER TABLE hipq_early_reply ADD COLUMN IF NOT EXISTS retry_at timestamptz;

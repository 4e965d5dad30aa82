-- hipq schema, version 3: indexes for the dead-letter list and for early
-- replies that name their job by id. (The jobs list needs none of its own:
-- every filter has an index already, read with plans made for the filter's
-- value; an index more on hipq_job would cost every write of the hot path.)

CREATE INDEX hipq_dead_letter_list_source ON hipq_dead_letter (source, id);

-- After a send, the early replies waiting for its job are found by
-- (type, key) or by job id.
CREATE INDEX hipq_early_reply_job_id ON hipq_early_reply (job_id) WHERE job_id IS NOT NULL;

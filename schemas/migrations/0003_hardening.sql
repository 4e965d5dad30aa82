-- hipq schema, version 3: indexes for the API's lists and for early
-- replies that name their job by id.

-- The API lists jobs newest first, filtered by type, state or queue: each
-- filter has an index in the list's order, so no filter value (a rare
-- state, say) walks the whole table, whatever plan PostgreSQL caches.
CREATE INDEX hipq_job_list_type ON hipq_job (job_type, id);
CREATE INDEX hipq_job_list_state ON hipq_job (state, id);
CREATE INDEX hipq_job_list_queue ON hipq_job (queue, id);

CREATE INDEX hipq_dead_letter_list_source ON hipq_dead_letter (source, id);

-- After a send, the early replies waiting for its job are found by
-- (type, key) or by job id.
CREATE INDEX hipq_early_reply_job_id ON hipq_early_reply (job_id) WHERE job_id IS NOT NULL;

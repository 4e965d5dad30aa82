-- hipq schema, version 5: W3C trace context, so a request sent days after
-- its intake, and a reply that comes back on another topic, join the trace
-- the job came in with, across restarts.
--
-- hipq_job: the traceparent (and tracestate) of the job's intake record,
-- outbox row or API call; NULL when it came with none (or an invalid one).
-- hipq_attempt: the traceparent of the attempt's send span, the parent of
-- the span that processes its reply. Written only while tracing is on.
-- Columns added NULL: no table rewrite.

ALTER TABLE hipq_job ADD COLUMN trace_parent text, ADD COLUMN trace_state text;
ALTER TABLE hipq_attempt ADD COLUMN trace_parent text;

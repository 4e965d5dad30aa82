package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Figures the demo and the bench print. They read whole tables: tools,
// not the hot path.

// Summary is what became of every job in the schema.
type Summary struct {
	Succeeded, Failed, Retried, Attempts, TimedOutAttempts, DeadLetters int
}

// RunSummary counts outcomes, attempts and dead letters.
func (s *Store) RunSummary(ctx context.Context) (Summary, error) {
	var r Summary
	// (Each table's count apart: Citus plans them one by one.)
	err := s.pool.QueryRow(ctx, `
		SELECT j.succeeded, j.failed, a.n, j.retried, j.attempts, d.n
		FROM (SELECT count(*) FILTER (WHERE outcome = 'succeeded') AS succeeded, count(*) FILTER (WHERE outcome = 'failed') AS failed,
		             count(*) FILTER (WHERE attempt > 1) AS retried, coalesce(sum(attempt), 0) AS attempts
		      FROM hipq_job) j,
		     (SELECT count(*) AS n FROM hipq_attempt WHERE outcome = 'timed_out') a,
		     (SELECT count(*) AS n FROM hipq_dead_letter) d`).Scan(&r.Succeeded, &r.Failed, &r.TimedOutAttempts, &r.Retried, &r.Attempts, &r.DeadLetters)
	if err != nil {
		return r, fmt.Errorf("summarize jobs: %w", err)
	}
	return r, nil
}

// Latencies are percentiles, in milliseconds, of succeeded jobs whose
// job_data.t holds the Unix time in nanoseconds at which they were
// produced (as hipq bench writes them).
type Latencies struct {
	Last                 time.Time  // the last job's end
	P50, P99, Max        float64    // produced → final
	Intake, Claim, Reply [2]float64 // p50, p99 of produced → stored, stored → claimed, claimed → final
	// The second of production (counted from the first job produced)
	// whose jobs had the highest p99, and that p99: where the tail is.
	SlowestSecond int
	SlowestP99    float64
}

// BenchLatencies reads the latencies of a bench run: the succeeded jobs
// of jobType.
func (s *Store) BenchLatencies(ctx context.Context, jobType string) (Latencies, error) {
	var l Latencies
	err := s.pool.QueryRow(ctx, `
		SELECT max(update_time),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY lat), percentile_cont(0.99) WITHIN GROUP (ORDER BY lat), max(lat),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY intake), percentile_cont(0.99) WITHIN GROUP (ORDER BY intake),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY claim), percentile_cont(0.99) WITHIN GROUP (ORDER BY claim),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY reply), percentile_cont(0.99) WITHIN GROUP (ORDER BY reply)
		FROM (SELECT update_time,
		             (extract(epoch FROM update_time) * 1e9 - (job_data->>'t')::float8) / 1e6 AS lat,
		             (extract(epoch FROM created_at) * 1e9 - (job_data->>'t')::float8) / 1e6 AS intake,
		             extract(epoch FROM started_at - created_at) * 1e3 AS claim,
		             extract(epoch FROM update_time - started_at) * 1e3 AS reply
		      FROM hipq_job WHERE job_type = $1 AND state = 'final' AND outcome = 'succeeded') l`, jobType).Scan(&l.Last, &l.P50, &l.P99, &l.Max,
		&l.Intake[0], &l.Intake[1], &l.Claim[0], &l.Claim[1], &l.Reply[0], &l.Reply[1])
	if err != nil {
		return l, fmt.Errorf("read bench latencies: %w", err)
	}
	err = s.pool.QueryRow(ctx, `
		SELECT sec, percentile_cont(0.99) WITHIN GROUP (ORDER BY lat) AS p99 FROM (
		  SELECT floor((t - min(t) OVER ()) / 1e9)::int AS sec, lat
		  FROM (SELECT (job_data->>'t')::float8 AS t,
		               (extract(epoch FROM update_time) * 1e9 - (job_data->>'t')::float8) / 1e6 AS lat
		        FROM hipq_job WHERE job_type = $1 AND state = 'final' AND outcome = 'succeeded') j) s
		GROUP BY sec
		-- (a second with a handful of jobs, the last one say, has a p99
		-- near its max: seconds of 50 jobs or more come first)
		ORDER BY count(*) >= 50 DESC, p99 DESC LIMIT 1`, jobType).Scan(&l.SlowestSecond, &l.SlowestP99)
	if err != nil {
		return l, fmt.Errorf("read bench latencies by second: %w", err)
	}
	return l, nil
}

// OutboxWrite commits values (intake JSON) to the outbox in one
// transaction, as an application would.
func (s *Store) OutboxWrite(ctx context.Context, values []string) error {
	if _, err := s.pool.Exec(ctx, `INSERT INTO hipq_intake (value) SELECT unnest($1::text[])`, values); err != nil {
		return fmt.Errorf("write the outbox: %w", err)
	}
	return nil
}

// DropSchema drops the store's schema and everything in it: for sandboxes
// on a shared database. It refuses the public schema.
func (s *Store) DropSchema(ctx context.Context) error {
	if s.schema == DefaultSchema {
		return fmt.Errorf("drop schema: refusing to drop public")
	}
	if _, err := s.pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{s.schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("drop schema %s: %w", s.schema, err)
	}
	return nil
}

// BenchSeed fills the table before a bench run: backlog jobs of jobType
// scheduled a day ahead (waiting, never due during the run), and final
// succeeded jobs of type "bench.old" with an attempt each, finished at
// finalAt and the hour before it. Inserted in chunks; progress is told
// after each.
func (s *Store) BenchSeed(ctx context.Context, queue, jobType string, backlog, finals int, finalAt time.Time, progress func(what string, done int)) error {
	const chunk = 200000
	for lo := 0; lo < backlog; lo += chunk {
		if _, err := s.pool.Exec(ctx, `INSERT INTO hipq_job (queue, job_type, job_key, job_data, scheduled_run_time)
			SELECT $1, $2, 'backlog-' || i, jsonb_build_object('i', i), now() + interval '1 day'
			FROM generate_series($3::int, $4::int - 1) i`, queue, jobType, lo, min(lo+chunk, backlog)); err != nil {
			return fmt.Errorf("seed the backlog: %w", err)
		}
		progress("backlog", min(lo+chunk, backlog))
	}
	for lo := 0; lo < finals; lo += chunk {
		if _, err := s.pool.Exec(ctx, `
			WITH j AS (
			  INSERT INTO hipq_job (queue, job_type, job_key, job_data, state, outcome, attempt, started_at, created_at, update_time, result)
			  SELECT $1, 'bench.old', 'old-' || i, jsonb_build_object('i', i), 'final', 'succeeded', 1,
			         t - interval '1 second', t - interval '2 seconds', t, '{"ok": true}'
			  FROM generate_series($2::int, $3::int - 1) i, LATERAL (SELECT $4::timestamptz - (i % 3600) * interval '1 second' AS t) x
			  RETURNING id, started_at, update_time
			)
			INSERT INTO hipq_attempt (queue, job_id, attempt, instance, dispatched_at, sent_at, replied_at, outcome, reply)
			SELECT $1, id, 1, 'seed', started_at, started_at, update_time, 'succeeded', '{"status": "succeeded"}' FROM j`,
			queue, lo, min(lo+chunk, finals), finalAt); err != nil {
			return fmt.Errorf("seed final jobs: %w", err)
		}
		progress("final rows", min(lo+chunk, finals))
	}
	if backlog > 0 || finals > 0 {
		if _, err := s.pool.Exec(ctx, `VACUUM ANALYZE hipq_job, hipq_attempt`); err != nil {
			return fmt.Errorf("vacuum the seeded tables: %w", err)
		}
		// The seeding's writes are flushed now rather than by a checkpoint
		// during the run (needs superuser or pg_checkpoint: else the run
		// may pay for it, as it would in production).
		_, _ = s.pool.Exec(ctx, `CHECKPOINT`)
	}
	return nil
}

// StatementTime is where PostgreSQL's time went for one family of
// statements during a bench run.
type StatementTime struct {
	Family string
	Calls  int64
	Rows   int64
	Millis float64
}

// StatementsReset starts a profile: pg_stat_statements is reset. It says
// why when the extension cannot be used (not in shared_preload_libraries,
// or not installable by this user). The extension is created only where
// it is missing: a Citus worker refuses CREATE EXTENSION, even one that
// would do nothing, and has it from its coordinator.
func (s *Store) StatementsReset(ctx context.Context) error {
	var have bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'pg_stat_statements')`).Scan(&have); err != nil {
		return fmt.Errorf("pg_stat_statements: %w", err)
	}
	if !have {
		if _, err := s.pool.Exec(ctx, `CREATE EXTENSION pg_stat_statements SCHEMA public`); err != nil {
			return fmt.Errorf("pg_stat_statements is not available: %w", err)
		}
	}
	if _, err := s.pool.Exec(ctx, `SELECT public.pg_stat_statements_reset()`); err != nil {
		return fmt.Errorf("pg_stat_statements is not usable (is it in shared_preload_libraries?): %w", err)
	}
	return nil
}

// StatementsRead returns the top-level statements' time since the reset,
// by family (what the statement is for), most expensive first.
//
// On a Citus worker the statements are those Citus sends to the shards:
// rewritten from the coordinator's (without their comments, operators
// spelled OPERATOR(pg_catalog.=)) and naming each shard by its table's
// name, schema and shard id (hipq_job_102008). They are read with the
// schema and the shard id dropped and the operators plain, and the few
// that carry no comment or form of the coordinator's to know them by are
// named by the form Citus gives them; the intermediate results (a CTE's
// rows sent to the worker) and the two-phase commits are families of
// their own.
func (s *Store) StatementsRead(ctx context.Context) ([]StatementTime, error) {
	rows, err := s.pool.Query(ctx, `
		SELECT family, sum(calls)::bigint, sum(rows)::bigint, sum(total_exec_time)::float8
		FROM (SELECT calls, rows, total_exec_time, CASE
		        WHEN q ILIKE '%/* claim%' OR q ILIKE '%hipq_claim/%' OR q ILIKE '%hipq_rate_%' OR q ILIKE 'SELECT set_config(''enable_sort''%'
		          OR q ILIKE 'SELECT id, state, attempt, job_type, expires_at, time_windows, scheduled_run_time, priority FROM hipq_job %'
		          OR q ILIKE '%attempt = (j.attempt + %' OR q ILIKE 'COPY hipq_attempt %' OR q ILIKE 'WITH RECURSIVE t(job_type) AS (%'
		          THEN 'claim (reads, plan writes, rate settling)'
		        WHEN q ILIKE '%due probe%' OR q ILIKE 'SET LOCAL enable_seqscan%' OR q ILIKE '%FROM unnest($2) t(job_type) WHERE%'
		          THEN 'due probes (dispatcher), planner settings'
		        WHEN q ILIKE '%INSERT INTO hipq_job%' OR q ILIKE 'COPY insert_select_%' THEN 'job inserts (intake, API, outbox)'
		        WHEN q ILIKE '%SET state = t.state%' THEN 'resolve (replies, timeouts)'
		        WHEN q ILIKE '%SET sent_at%' THEN 'sent marks'
		        WHEN q ILIKE '%FROM hipq_job WHERE queue = $1 AND id = ANY($2) ORDER BY id FOR UPDATE%'
		          OR q ILIKE 'SELECT $1 AS "?column?" FROM hipq_job hipq_job WHERE ((queue = $2::text) AND (id = ANY ($3::bigint[]))) ORDER BY id FOR UPDATE%'
		          THEN 'job locks (deliveries, resolves)'
		        WHEN q ILIKE '%time_windows, coalesce(started_at, %' OR q ILIKE '%SELECT j.queue, j.id FROM hipq_job j WHERE j.id = ANY%'
		          OR q ILIKE 'SELECT queue, id FROM hipq_job j WHERE (id = ANY %'
		          OR q ILIKE '%j.queue AS worker_column_1, j.id AS worker_column_2 FROM (hipq_job j JOIN %' THEN 'reply lookup'
		        WHEN q ILIKE '%hipq_offset%' THEN 'consumed offsets'
		        WHEN q ILIKE '%hipq_intake%' THEN 'outbox reads'
		        WHEN q ILIKE '%USING undone%' THEN 'undone claims'
		        WHEN q ILIKE '%DELETE FROM hipq_job%' OR q ILIKE '%DELETE FROM hipq_attempt%'
		          OR q ILIKE '%state = ''final'' AND update_time <%' THEN 'retention prune'
		        WHEN q ILIKE 'ANALYZE%' OR q ILIKE '%pg_relation_size%' OR q ILIKE '%relpages FROM pg_class%' THEN 'statistics (StatsRefresh)'
		        WHEN q ILIKE '%hipq_activity%' THEN 'dashboard activity'
		        WHEN q ILIKE 'BEGIN%' OR q ILIKE 'COMMIT%' OR q ILIKE 'ROLLBACK%' OR q ILIKE 'PREPARE TRANSACTION%'
		          OR q ILIKE 'SELECT assign_distributed_transaction_id(%' THEN 'transaction control'
		        WHEN q ILIKE 'COPY "%" FROM STDIN WITH (format result)' THEN 'intermediate results (Citus)'
		        WHEN q ILIKE '%hipq_attempt%' OR q ILIKE '%hipq_early_reply%' THEN 'sweeper and attempts'
		        WHEN q ILIKE '%pg_notify%' OR q ILIKE 'LISTEN%' THEN 'notifications'
		        WHEN q ILIKE '%hipq_event%' OR q ILIKE '%SET event_id = NULL%' OR q ILIKE 'SELECT pg_snapshot_xmin(%'
		          OR q ILIKE 'SELECT pg_current_xact_id()%' OR q ILIKE 'SELECT set_config(''enable_seqscan''%'
		          THEN 'outcome events (relay)'
		        ELSE 'other' END AS family
		      FROM (SELECT calls, rows, total_exec_time,
		              regexp_replace(regexp_replace(regexp_replace(query, '\s+', ' ', 'g'),
		                '(\w+\.)?(hipq_[a-z_]+)_[0-9]+', '\2', 'g'),
		                'OPERATOR\(pg_catalog\.([^)]+)\)', '\1', 'g') AS q
		            FROM public.pg_stat_statements
		            WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
		              AND toplevel) s
		      WHERE q NOT ILIKE '%pg_stat_statements%' AND q NOT ILIKE '%percentile_cont%') f
		GROUP BY family ORDER BY 4 DESC`)
	if err != nil {
		return nil, fmt.Errorf("read pg_stat_statements: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (StatementTime, error) {
		var t StatementTime
		err := r.Scan(&t.Family, &t.Calls, &t.Rows, &t.Millis)
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("read pg_stat_statements: %w", err)
	}
	return out, nil
}

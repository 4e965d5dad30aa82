package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// statsSmallPages is the size (8 KB pages) under which StatsRefresh
// follows a table's growth: 2.5 MB.
const statsSmallPages = 320

// statsColumns are the columns StatsRefresh analyzes, by table: those the
// hot statements filter on (job_type: every claim and due probe names its
// types; without statistics on it, job_type = ANY(types) looks selective
// to the planner, which would rather sort the due range than walk it in
// order, where its settings leave it the choice).
var statsColumns = map[string]string{"hipq_job": " (queue, state, job_type)", "hipq_attempt": " (queue, job_id)"}

// StatsRefresh analyzes hipq_job and hipq_attempt when either has rows
// and was never analyzed, or has grown to more than twice the size its
// statistics last recorded while those say it is small (under
// statsSmallPages), and returns the tables it analyzed.
//
// Why: statements are planned once per connection and their generic plan
// is kept (pgx prepares them). A plan made while the table was nearly
// empty reads it by sequential scans, which is right for ten rows and not
// for a hundred thousand, and it is kept until the table's statistics
// change. Autovacuum looks at a table at most once per
// autovacuum_naptime (a minute by default): a burst that fills an empty
// table within that minute would run on such plans.
// A table never analyzed is worse: without statistics the planner takes
// `queue = $1` to keep 0.5% of the rows, so a few hundred attempts look
// like one, and a join to a batch could scan them once per row of the
// batch; it is analyzed as soon as it has rows. Sent marks and reply
// lookups probe each row of their batch once whatever their plan; the
// resolve's update of attempts does once the table has statistics
// (TestHotPathsStayLinearOnNewTables). A stale plan may still read the
// whole table once per batch, each row compared with the batch's list:
// fresh statistics make the plans probe by key or tuple id instead
// (TestStatsFollowGrowth). ANALYZE replaces
// the statistics, which invalidates every cached plan of the table.
//
// Plans go wrong only while statistics say the table is tiny (a few dozen
// pages: then a scan looks cheaper than reaching rows by key), so the
// table is analyzed each time it doubles until its statistics say 2.5 MB,
// and left to autovacuum after (again after a TRUNCATE or a vacuum that
// shrinks it); and only the columns the hot statements filter on are
// analyzed (the sample still gives the table's size): a handful of quick
// analyzes as a table grows from empty. SKIP_LOCKED: a table being
// vacuumed or analyzed is left to that. Only tables whose owner's
// privileges this role has are analyzed (ANALYZE skips the others, with a
// warning).
func (s *Store) StatsRefresh(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, `
		SELECT c.relname, c.relpages FROM pg_class c
		WHERE c.oid = ANY (ARRAY['hipq_job'::regclass, 'hipq_attempt'::regclass])
		  AND pg_has_role(c.relowner, 'USAGE')
		  AND c.relpages < $1
		  AND (pg_relation_size(c.oid) > 2 * greatest(c.relpages, 10)::bigint * current_setting('block_size')::bigint
		       OR (c.reltuples < 0 AND pg_relation_size(c.oid) > 0))
		ORDER BY 1`, statsSmallPages)
	if err != nil {
		return nil, fmt.Errorf("read table sizes: %w", err)
	}
	type table struct {
		Name  string
		Pages int32
	}
	grown, err := pgx.CollectRows(rows, pgx.RowToStructByPos[table])
	if err != nil {
		return nil, fmt.Errorf("read table sizes: %w", err)
	}
	var done []string
	for _, t := range grown {
		// (ANALYZE skips a table it cannot lock at once, with a warning,
		// not an error: relpages, which the table's growth changes, tells
		// whether it ran.)
		var pages int32
		if _, err := s.pool.Exec(ctx, "ANALYZE (SKIP_LOCKED) "+pgx.Identifier{t.Name}.Sanitize()+statsColumns[t.Name]); err != nil {
			return done, fmt.Errorf("analyze %s: %w", t.Name, err)
		}
		if err := s.pool.QueryRow(ctx, `SELECT relpages FROM pg_class WHERE oid = $1::regclass`, t.Name).Scan(&pages); err != nil {
			return done, fmt.Errorf("analyze %s: %w", t.Name, err)
		}
		if pages != t.Pages {
			done = append(done, t.Name)
		}
	}
	return done, nil
}

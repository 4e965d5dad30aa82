package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// StatsRefresh analyzes hipq_job and hipq_attempt when either has grown to
// more than twice the size its statistics last recorded, while those say
// it is small (under statsSmallPages), and returns the tables it analyzed.
//
// Why: statements are planned once per connection and their generic plan
// is kept (pgx prepares them; PL/pgSQL caches the claim's). A plan made
// while the table was nearly empty joins by sequential scans, which is
// right for ten rows and quadratic for a hundred thousand, and it is kept
// until the table's statistics change. Autovacuum looks at a table at most
// once per autovacuum_naptime (a minute by default): a burst that fills an
// empty table within that minute ran on such plans (two instances: one
// claim took 12 s). ANALYZE replaces the statistics, which invalidates
// every cached plan of the table. Plans go wrong only while statistics say
// the table is tiny (a few dozen pages: then a scan looks cheaper than
// reaching rows by key), so the table is analyzed each time it doubles
// until its statistics say 2.5 MB, and left to autovacuum after; and only
// the columns the hot statements filter on are analyzed (the sample still
// gives the table's size): six quick analyzes per table in its life, each
// well under a millisecond per thousand rows. SKIP_LOCKED: a table being
// vacuumed or analyzed is left to that. Only tables this role owns are
// analyzed (ANALYZE skips the others).
const statsSmallPages = 320

// statsColumns are the columns StatsRefresh analyzes, by table.
var statsColumns = map[string]string{"hipq_job": " (queue, state)", "hipq_attempt": " (queue, job_id)"}

func (s *Store) StatsRefresh(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, `
		SELECT c.relname FROM pg_class c
		WHERE c.oid = ANY (ARRAY['hipq_job'::regclass, 'hipq_attempt'::regclass])
		  AND pg_has_role(c.relowner, 'MEMBER')
		  AND c.relpages < $1
		  AND pg_relation_size(c.oid) > 2 * greatest(c.relpages, 10)::bigint * current_setting('block_size')::bigint
		ORDER BY 1`, statsSmallPages)
	if err != nil {
		return nil, fmt.Errorf("read table sizes: %w", err)
	}
	grown, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read table sizes: %w", err)
	}
	for _, t := range grown {
		if _, err := s.pool.Exec(ctx, "ANALYZE (SKIP_LOCKED) "+pgx.Identifier{t}.Sanitize()+statsColumns[t]); err != nil {
			return nil, fmt.Errorf("analyze %s: %w", t, err)
		}
	}
	return grown, nil
}

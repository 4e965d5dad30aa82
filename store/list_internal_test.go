package store

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/internal/localpg"
)

// planStore is a store on a private cluster of its own (plans must not
// see other tests' rows), migrated; both close when the test ends.
func planStore(t *testing.T) (*localpg.Cluster, *Store) {
	t.Helper()
	pg, err := localpg.Start(context.Background(), localpg.Options{})
	if err != nil {
		t.Skip(err)
	}
	t.Cleanup(pg.Stop)
	st, err := Open(context.Background(), Config{URL: pg.URL("postgres")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	if _, err := st.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return pg, st
}

// planText reads an EXPLAIN's lines as one text.
func planText(t *testing.T) func(pgx.Rows, error) string {
	return func(rows pgx.Rows, err error) string {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(lines, "\n")
	}
}

// Issue 9.17: every list the API makes reads an index for its filter, on
// a table of 100k jobs where a state, a type and a queue are rare, also at
// the sixth run of a prepared statement (where PostgreSQL may switch to a
// generic plan made for the average value): no sequential scan, no walk of
// the primary key for a rare value. state=error answers at once: a
// committed row is never in error.
func TestListsUseAnIndexForEachFilter(t *testing.T) {
	t.Parallel()
	pg, st := planStore(t)
	ctx := context.Background()
	if _, err := st.pool.Exec(ctx, `
		INSERT INTO hipq_job (queue, job_type, job_key, state, outcome)
		SELECT 'q' || (i % 5), 't' || (i % 20), 'k' || i,
		       CASE WHEN i % 1000 = 0 THEN 'retry' WHEN i % 1000 = 1 THEN 'running' ELSE 'final' END,
		       CASE WHEN i % 1000 > 1 THEN 'succeeded' END
		FROM generate_series(1, 100000) i;
		INSERT INTO hipq_job (queue, job_type, job_key, state, outcome)
		SELECT 'rare', 'rt', 'r' || i, 'final', 'succeeded' FROM generate_series(1, 50) i;
		INSERT INTO hipq_dead_letter (source, reason) SELECT CASE WHEN i % 100 = 0 THEN 'callback' ELSE 'intake' END, 'x: y'
		FROM generate_series(1, 20000) i;
		ANALYZE hipq_job; ANALYZE hipq_dead_letter;`); err != nil {
		t.Fatal(err)
	}
	type c struct {
		name  string
		q     string
		args  []any
		index string
	}
	var cases []c
	for _, p := range []struct {
		p     JobListParams
		index string
	}{
		{JobListParams{State: "retry", Limit: 100}, "hipq_job_due_"},
		{JobListParams{State: "running", Limit: 100}, "hipq_job_running"},
		{JobListParams{JobType: "nope", Limit: 100}, "hipq_job_active_key hipq_job_final_key"},
		{JobListParams{JobType: "rt", Limit: 100}, "hipq_job_active_key hipq_job_final_key"},
		{JobListParams{Queue: "rare", QueueTypes: []string{"rt"}, Limit: 100}, "hipq_job_active_key hipq_job_final_key"},
		{JobListParams{JobType: "rt", KeyPrefix: "r1", Limit: 100}, "hipq_job_active_key hipq_job_final_key"},
		{JobListParams{JobType: "rt", State: "final", Limit: 100}, "hipq_job_final_key"},
		{JobListParams{JobType: "t3", State: "retry", BeforeID: 50000, Limit: 100}, "hipq_job_"},
		{JobListParams{Limit: 100, BeforeID: 50000}, "hipq_job_pkey"},
	} {
		q, args := jobListQuery(p.p)
		cases = append(cases, c{name: q, q: q, args: args, index: p.index})
	}
	f := listFilter{}
	f.add("source", "replay")
	q, args := f.query(`SELECT `+deadLetterColumns+` FROM hipq_dead_letter`, 0, 100)
	cases = append(cases, c{name: q, q: q, args: args, index: "hipq_dead_letter_list_source"})
	// The API's connections plan each statement for its values; with the
	// default plan cache, a filter of a rare value would run the generic
	// plan made for the average one after five runs.
	api, err := Open(ctx, Config{URL: pg.URL("postgres"), CustomPlans: true})
	if err != nil {
		t.Fatal(err)
	}
	defer api.Close()
	plan := func(st *Store, tc c, settings ...string) string {
		conn, err := st.pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		for _, set := range settings {
			if _, err := conn.Exec(ctx, set); err != nil {
				t.Fatal(err)
			}
			defer conn.Exec(ctx, "RESET ALL") //nolint:errcheck // only a broken connection fails it, and its settings went with it
		}
		var lits []string
		for _, a := range tc.args {
			switch v := a.(type) {
			case string:
				lits = append(lits, "'"+v+"'")
			case []string:
				lits = append(lits, "ARRAY['"+strings.Join(v, "','")+"']")
			default:
				lits = append(lits, fmt.Sprint(v))
			}
		}
		if _, err := conn.Exec(ctx, "DEALLOCATE ALL"); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "PREPARE l AS "+tc.q); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		var out string
		for range 6 { // the sixth run is where PostgreSQL may switch to the generic plan
			out = planText(t)(conn.Query(ctx, "EXPLAIN EXECUTE l("+strings.Join(lits, ", ")+")", pgx.QueryExecModeSimpleProtocol))
		}
		return out
	}
	// The control: a list statement with every filter in one text
	// ($n = '' OR col = $n) walks the primary key once PostgreSQL runs its
	// generic plan, whatever the value; the API's connections never run a
	// generic plan.
	old := c{name: "the former list statement", q: `SELECT ` + jobColumns + ` FROM hipq_job
		WHERE ($1 = '' OR job_type = $1) AND ($2 = '' OR state = $2) AND ($3 = '' OR queue = $3) AND ($4 = 0 OR id < $4)
		ORDER BY id DESC LIMIT $5`, args: []any{"", "retry", "", 0, 100}}
	if p := plan(st, old, "SET plan_cache_mode = force_generic_plan"); !strings.Contains(p, "hipq_job_pkey") || !strings.Contains(p, "Filter") {
		t.Errorf("the control no longer shows the walk:\n%s", p)
	}
	if jobs, err := api.JobList(ctx, JobListParams{State: "error", Limit: 100}); err != nil || len(jobs) != 0 {
		t.Fatalf("state=error: %d jobs, %v", len(jobs), err)
	}
	for _, tc := range cases {
		p := plan(api, tc)
		missing := false
		for _, index := range strings.Fields(tc.index) {
			missing = missing || !strings.Contains(p, index)
		}
		if strings.Contains(p, "Seq Scan") || missing || (tc.index != "hipq_job_pkey" && strings.Contains(p, "hipq_job_pkey")) {
			t.Errorf("%s\nplan:\n%s\nwant index scans of %q", tc.name, p, tc.index)
		}
	}
}

package store_test

import (
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// lastVersionWithFunctions is the last released versioned migration that
// defines SQL functions (their history: the repeatable migrations define
// them now).
const lastVersionWithFunctions = 16

// sqlCode is a migration's text without its comment lines.
func sqlCode(m store.Migration) string {
	var b strings.Builder
	for _, l := range strings.Split(m.SQL, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "--") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// A function lives in one file, a repeatable migration: no versioned
// migration after the released ones defines or alters one, and every
// repeatable one defines its functions with CREATE OR REPLACE (it is
// applied again over them), its settings in their definition.
func TestFunctionsLiveInRepeatables(t *testing.T) {
	ms, err := store.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	routine := regexp.MustCompile(`(?i)\b(CREATE\s+(OR\s+REPLACE\s+)?|ALTER\s+)(FUNCTION|PROCEDURE)\b`)
	for _, m := range ms {
		if m.Version <= lastVersionWithFunctions {
			continue
		}
		if f := routine.FindString(sqlCode(m)); f != "" {
			t.Errorf("%s has %q: a function is defined in schemas/repeatable/NAME.sql, with its settings in its definition", m, f)
		}
	}
	rs, err := store.Repeatables()
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) == 0 {
		t.Fatal("no repeatable migrations")
	}
	create := regexp.MustCompile(`(?i)\bCREATE\s+(OR\s+REPLACE\s+)?([A-Z]+)`)
	for _, r := range rs {
		for _, c := range create.FindAllStringSubmatch(sqlCode(r), -1) {
			if c[1] == "" {
				t.Errorf("%s has %q: a repeatable migration is applied again over what it made, with CREATE OR REPLACE", r, c[0])
			}
		}
		if alter := regexp.MustCompile(`(?i)\bALTER\s+(FUNCTION|PROCEDURE)\b`).FindString(sqlCode(r)); alter != "" {
			t.Errorf("%s has %q: settings go in the definition (CREATE OR REPLACE resets them)", r, alter)
		}
	}
}

// recordChecksum sets the checksum recorded for a repeatable migration, as
// if the database had been migrated from another text of it.
func recordChecksum(t *testing.T, st *store.Store, name, sum string) {
	t.Helper()
	tag, err := st.Pool().Exec(ctx, "UPDATE hipq_schema_repeatable SET checksum = $2 WHERE name = $1", name, sum)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("record checksum of %s: %v %v", name, tag, err)
	}
}

// prosrc is a function's body as the database holds it.
func prosrc(t *testing.T, st *store.Store, fn string) string {
	t.Helper()
	var src string
	if err := st.Pool().QueryRow(ctx, "SELECT prosrc FROM pg_proc WHERE oid = $1::regproc", fn).Scan(&src); err != nil {
		t.Fatal(err)
	}
	return src
}

func names(ms []store.Migration) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.String())
	}
	return out
}

// A repeatable migration whose text differs from the one recorded is
// applied again; one whose recorded checksum is this build's is not, even
// when its body was changed by hand; until then the schema is not
// current.
func TestRepeatableAppliedWhenItsTextChanges(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	notify := prosrc(t, st, "hipq_intake_notify")
	if _, err := st.Pool().Exec(ctx, `CREATE OR REPLACE FUNCTION hipq_intake_notify() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$`); err != nil {
		t.Fatal(err)
	}
	if applied, err := st.Migrate(ctx); err != nil || len(applied) != 0 {
		t.Fatalf("migrate applied %v (%v), want nothing: the recorded checksum is this build's", names(applied), err)
	}
	if got := prosrc(t, st, "hipq_intake_notify"); got == notify {
		t.Fatal("hipq_intake_notify, whose recorded text did not change, was applied again")
	}
	recordChecksum(t, st, "hipq_intake_notify", "another text")
	if err := st.CheckSchema(ctx); err == nil || !strings.Contains(err.Error(), "hipq_intake_notify") {
		t.Fatalf("check with hipq_intake_notify from another text: %v, want an error naming it", err)
	}
	applied, err := st.Migrate(ctx)
	if err != nil || !slices.Equal(names(applied), []string{"repeatable hipq_intake_notify"}) {
		t.Fatalf("migrate applied %v (%v), want hipq_intake_notify alone", names(applied), err)
	}
	if got := prosrc(t, st, "hipq_intake_notify"); got != notify {
		t.Fatal("hipq_intake_notify is not this build's again")
	}
	if err := st.CheckSchema(ctx); err != nil {
		t.Fatalf("check after migrate: %v", err)
	}
	if applied, err := st.Migrate(ctx); err != nil || len(applied) != 0 {
		t.Fatalf("migrate again applied %v (%v)", names(applied), err)
	}
	rs, err := st.RepeatableStatus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if r.AppliedAt == nil {
			t.Errorf("%s is pending after migrate", r)
		}
	}
}

// After any versioned migration, every repeatable one is applied again
// (an older versioned migration run again defines the same functions),
// and a run cut short between the two applies them at the next start.
func TestRepeatablesFollowVersionedMigrations(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	rs, err := store.Repeatables()
	if err != nil {
		t.Fatal(err)
	}
	notify := prosrc(t, st, "hipq_intake_notify")
	stale := func() {
		t.Helper()
		if _, err := st.Pool().Exec(ctx, `CREATE OR REPLACE FUNCTION hipq_intake_notify() RETURNS trigger LANGUAGE plpgsql
			AS $$ BEGIN RETURN NULL; END $$`); err != nil {
			t.Fatal(err)
		}
	}
	stale()
	if _, err := st.Pool().Exec(ctx, "DELETE FROM hipq_schema_migration WHERE version >= 19"); err != nil {
		t.Fatal(err)
	}
	applied, err := st.Migrate(ctx)
	versioned := []string{"0019_due_by_type", "0020_claim_in_go", "0021_events"}
	want := slices.Clone(versioned)
	for _, r := range rs {
		want = append(want, r.String())
	}
	if err != nil || !slices.Equal(names(applied), want) {
		t.Fatalf("migrate applied %v (%v), want %v", names(applied), err, want)
	}
	if prosrc(t, st, "hipq_intake_notify") != notify {
		t.Fatal("hipq_intake_notify was not applied again after the versioned migrations")
	}
	// Cut short after the versioned migrations: their checksums are gone.
	stale()
	if _, err := st.Pool().Exec(ctx, "DELETE FROM hipq_schema_repeatable"); err != nil {
		t.Fatal(err)
	}
	if err := st.CheckSchema(ctx); err == nil {
		t.Fatal("check passes with no repeatable migration recorded")
	}
	if applied, err := st.Migrate(ctx); err != nil || !slices.Equal(names(applied), want[len(versioned):]) {
		t.Fatalf("migrate after a cut-short run applied %v (%v), want %v", names(applied), err, want[len(versioned):])
	}
	if prosrc(t, st, "hipq_intake_notify") != notify {
		t.Fatal("hipq_intake_notify was not applied after a cut-short run")
	}
}

// Instances migrating at once take turns: each repeatable migration is
// applied once, by one of them, and neither fails.
func TestMigrateConcurrentlyAppliesRepeatablesOnce(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	var stores []*store.Store
	for range 2 {
		st, err := store.Open(ctx, store.Config{URL: url})
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		stores = append(stores, st)
	}
	if _, err := stores[0].Pool().Exec(ctx, "DELETE FROM hipq_schema_repeatable"); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	applied := make([][]store.Migration, len(stores))
	errs := make([]error, len(stores))
	for i, st := range stores {
		wg.Add(1)
		go func() { defer wg.Done(); applied[i], errs[i] = st.Migrate(ctx) }()
	}
	wg.Wait()
	var all []string
	for i := range stores {
		if errs[i] != nil {
			t.Fatalf("instance %d: %v", i, errs[i])
		}
		all = append(all, names(applied[i])...)
	}
	rs, err := store.Repeatables()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(all)
	if want := names(rs); !slices.Equal(all, want) {
		t.Fatalf("applied %v between them, want each of %v once", all, want)
	}
	if err := stores[1].CheckSchema(ctx); err != nil {
		t.Fatal(err)
	}
}

// No migration defines a function that decides the claim: it is decided
// in Go (correlator.PlanClaim), and the migrations hold no copy of a
// claim function, old or new; version 20 drops any a database holds.
func TestNoMigrationDefinesTheClaim(t *testing.T) {
	ms, err := store.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	rs, err := store.Repeatables()
	if err != nil {
		t.Fatal(err)
	}
	def := regexp.MustCompile(`(?i)\b(CREATE\s+(OR\s+REPLACE\s+)?|ALTER\s+)FUNCTION\s+hipq_(claim|window_open)\b`)
	for _, m := range append(ms, rs...) {
		if f := def.FindString(sqlCode(m)); f != "" {
			t.Errorf("%s has %q: the claim is decided in Go, no SQL function decides it", m, f)
		}
	}
}

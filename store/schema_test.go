package store_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

var update = flag.Bool("update", false, "write the migrated schema to schemas/schema.sql (make schema)")

const snapshotFile = "../schemas/schema.sql"

// skipSnapshotOnCitus is why the snapshot is not compared on Citus.
const skipSnapshotOnCitus = "schemas/schema.sql is the single-node schema; on Citus the keys include queue (TestMigrateLaysOutCitus checks them)"

// The migrated schema is the one schemas/schema.sql shows: a change to the
// schema is seen in review as a change of that file, and a migration that
// changes more (or less) than the file says fails here. `make schema`
// writes the file from a freshly migrated database.
func TestSchemaSnapshot(t *testing.T) {
	t.Parallel()
	if pgtest.OnCitus() {
		t.Skip(skipSnapshotOnCitus)
	}
	st := pgtest.New(t)
	got := schemaSnapshot(t, st.Pool(), store.DefaultSchema)
	if *update {
		if err := os.WriteFile(snapshotFile, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	compareSnapshot(t, got, "a freshly migrated database")
}

// A database migrated by the release of version 16 and then upgraded ends
// with the same schema as a fresh one: the same tables, columns, indexes
// and constraints, and the functions of the repeatable migrations in place
// of those the older migrations defined.
func TestSchemaSnapshotAfterUpgradeFrom16(t *testing.T) {
	t.Parallel()
	const schema = "hipq_from16"
	st, err := store.Open(ctx, store.Config{URL: pgtest.URL(t), Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	migrateAsRelease(t, st.Pool(), schema, 16)
	if applied, err := st.Migrate(ctx); err != nil || len(applied) == 0 || applied[0].Version != 17 {
		t.Fatalf("upgrade from 16: applied %v, %v", applied, err)
	}
	if pgtest.OnCitus() {
		t.Skip("upgraded; not compared: " + skipSnapshotOnCitus)
	}
	compareSnapshot(t, schemaSnapshot(t, st.Pool(), schema), "a database migrated to version 16, then upgraded")
}

// migrateAsRelease applies the versioned migrations up to version as the
// runner of that release did: each in a transaction, or statement by
// statement for those that run outside one, recorded in
// hipq_schema_migration; no repeatable migrations (there were none).
func migrateAsRelease(t *testing.T, pool *pgxpool.Pool, schema string, version int) {
	t.Helper()
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%.80s: %v", q, err)
		}
	}
	exec("CREATE SCHEMA " + pgx.Identifier{schema}.Sanitize())
	exec(`CREATE TABLE hipq_schema_migration (
		version int PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`)
	ms, err := store.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.Version > version {
			break
		}
		if m.NoTransaction() {
			for _, q := range m.Statements() {
				exec(q)
			}
		} else if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, m.SQL)
			return err
		}); err != nil {
			t.Fatalf("%s: %v", m, err)
		}
		exec("INSERT INTO hipq_schema_migration (version, name) VALUES ($1, $2)", m.Version, m.Name)
	}
}

// compareSnapshot fails unless got is the text of schemas/schema.sql,
// showing where they differ.
func compareSnapshot(t *testing.T, got, what string) {
	t.Helper()
	b, err := os.ReadFile(snapshotFile)
	if err != nil {
		t.Fatalf("%v: write it with `make schema`", err)
	}
	if d := lineDiff(string(b), got); d != "" {
		t.Fatalf("the schema of %s differs from schemas/schema.sql (- the file, + the database):\n%s\n"+
			"If the migrations are right, regenerate the file: make schema (go test ./store -run '^TestSchemaSnapshot$' -update)", what, d)
	}
}

// lineDiff shows the lines where want and got differ, between their
// common first and last lines, with their line numbers in want: "" when
// they are equal.
func lineDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	if slices.Equal(w, g) {
		return ""
	}
	pre := 0
	for pre < len(w) && pre < len(g) && w[pre] == g[pre] {
		pre++
	}
	suf := 0
	for suf < len(w)-pre && suf < len(g)-pre && w[len(w)-1-suf] == g[len(g)-1-suf] {
		suf++
	}
	const most = 20
	var b strings.Builder
	fmt.Fprintf(&b, "@@ schemas/schema.sql line %d @@\n", pre+1)
	if pre > 0 {
		fmt.Fprintf(&b, "  %s\n", w[pre-1])
	}
	for i, l := range w[pre : len(w)-suf] {
		if i == most {
			fmt.Fprintf(&b, "- … %d lines more\n", len(w)-suf-pre-most)
			break
		}
		fmt.Fprintf(&b, "- %s\n", l)
	}
	for i, l := range g[pre : len(g)-suf] {
		if i == most {
			fmt.Fprintf(&b, "+ … %d lines more\n", len(g)-suf-pre-most)
			break
		}
		fmt.Fprintf(&b, "+ %s\n", l)
	}
	return b.String()
}

func TestLineDiff(t *testing.T) {
	if d := lineDiff("a\nb\n", "a\nb\n"); d != "" {
		t.Fatalf("equal texts: %q", d)
	}
	want := "@@ schemas/schema.sql line 2 @@\n  a\n- b\n+ x\n+ y\n"
	if d := lineDiff("a\nb\nc\n", "a\nx\ny\nc\n"); d != want {
		t.Fatalf("got\n%s\nwant\n%s", d, want)
	}
}

// schemaSnapshot is the text of schemas/schema.sql for the given schema,
// read from PostgreSQL's catalogs: its tables with their columns
// (in their order), storage settings, constraints, indexes and triggers,
// its sequences, views, types and functions, each kind sorted by name, and
// every name written without the schema. Objects of extensions are left
// out; an object of a kind not described here is named in an OTHER line,
// so that it shows in the comparison all the same.
func schemaSnapshot(t *testing.T, pool *pgxpool.Pool, schema string) string {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// The store's connections have the schema as their search path:
	// PostgreSQL writes its names unqualified where it may (what the
	// search path finds), and the ones it qualifies anyway are stripped
	// below.
	rows := func(q string, args ...any) [][]string {
		t.Helper()
		r, err := conn.Query(ctx, q, args...)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		out, err := pgx.CollectRows(r, func(row pgx.CollectableRow) ([]string, error) {
			vals, err := row.Values()
			if err != nil {
				return nil, err
			}
			s := make([]string, len(vals))
			for i, v := range vals {
				if v != nil {
					s[i] = fmt.Sprint(v)
				}
			}
			return s, nil
		})
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		return out
	}
	// Objects that belong to an extension are the extension's.
	const notExt = `NOT EXISTS (SELECT 1 FROM pg_depend e WHERE e.objid = %s AND e.deptype = 'e')`
	var b strings.Builder
	version := rows("SELECT coalesce(max(version), 0)::text FROM hipq_schema_migration")[0][0]
	fmt.Fprintf(&b, "-- hipq's schema at version %s, with its repeatable migrations applied, as\n", version)
	b.WriteString("-- PostgreSQL's catalogs describe it. Written by `make schema`; TestSchemaSnapshot\n")
	b.WriteString("-- (store) fails when the migrated schema differs. Do not edit.\n")

	for _, tbl := range rows(`SELECT c.oid::text, quote_ident(c.relname), c.relkind::text, coalesce(array_to_string(c.reloptions, chr(31)), '')
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND `+fmt.Sprintf(notExt, "c.oid")+` ORDER BY c.relname`, schema) {
		oid, name := tbl[0], tbl[1]
		b.WriteString("\nCREATE TABLE " + name + " (\n")
		cols := rows(`SELECT quote_ident(a.attname), format_type(a.atttypid, a.atttypmod), a.attnotnull::text, a.attidentity::text, a.attgenerated::text,
				coalesce(pg_get_expr(d.adbin, d.adrelid), ''),
				CASE WHEN a.attcollation <> ty.typcollation THEN quote_ident(co.collname) ELSE '' END
			FROM pg_attribute a JOIN pg_type ty ON ty.oid = a.atttypid
			LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
			LEFT JOIN pg_collation co ON co.oid = a.attcollation
			WHERE a.attrelid = $1::text::oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum`, oid)
		for i, c := range cols {
			line := "    " + c[0] + " " + c[1]
			if c[6] != "" {
				line += " COLLATE " + c[6]
			}
			switch c[3] {
			case "a":
				line += " GENERATED ALWAYS AS IDENTITY"
			case "d":
				line += " GENERATED BY DEFAULT AS IDENTITY"
			}
			switch {
			case c[4] == "s":
				line += " GENERATED ALWAYS AS (" + c[5] + ") STORED"
			case c[5] != "":
				line += " DEFAULT " + c[5]
			}
			if c[2] == "true" {
				line += " NOT NULL"
			}
			if i < len(cols)-1 {
				line += ","
			}
			b.WriteString(line + "\n")
		}
		if tbl[2] == "p" {
			b.WriteString(") PARTITION BY " + rows("SELECT pg_get_partkeydef($1::text::oid)", oid)[0][0] + ";\n")
		} else {
			b.WriteString(");\n")
		}
		if tbl[3] != "" {
			opts := strings.Split(tbl[3], "\x1f")
			slices.Sort(opts)
			b.WriteString("ALTER TABLE " + name + " SET (" + strings.Join(opts, ", ") + ");\n")
		}
		// NOT NULL is the columns' (PostgreSQL 18 also lists it as
		// constraints); the indexes of keys and exclusions are their
		// constraints'.
		for _, c := range rows(`SELECT quote_ident(conname), pg_get_constraintdef(oid, true) FROM pg_constraint
			WHERE conrelid = $1::text::oid AND contype IN ('c', 'f', 'p', 'u', 'x') ORDER BY conname`, oid) {
			b.WriteString("ALTER TABLE " + name + " ADD CONSTRAINT " + c[0] + " " + c[1] + ";\n")
		}
		for _, ix := range rows(`SELECT ic.relname, pg_get_indexdef(i.indexrelid), i.indisvalid::text
			FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
			WHERE i.indrelid = $1::text::oid AND NOT EXISTS (SELECT 1 FROM pg_constraint co
				WHERE co.conindid = i.indexrelid AND co.conrelid = i.indrelid AND co.contype IN ('p', 'u', 'x'))
			ORDER BY ic.relname`, oid) {
			line := ix[1] + ";"
			if ix[2] != "true" {
				line += " -- INVALID"
			}
			b.WriteString(line + "\n")
		}
		for _, tg := range rows(`SELECT pg_get_triggerdef(oid, true), tgenabled::text FROM pg_trigger
			WHERE tgrelid = $1::text::oid AND NOT tgisinternal ORDER BY tgname`, oid) {
			line := tg[0] + ";"
			if tg[1] == "D" {
				line += " -- DISABLED"
			}
			b.WriteString(line + "\n")
		}
	}

	seqs := rows(`SELECT quote_ident(c.relname), format_type(s.seqtypid, NULL), s.seqstart::text, s.seqincrement::text,
			s.seqmin::text, s.seqmax::text, s.seqcache::text, s.seqcycle::text,
			coalesce((SELECT quote_ident(tc.relname) || '.' || quote_ident(a.attname) FROM pg_depend d
				JOIN pg_class tc ON tc.oid = d.refobjid
				JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
				WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.refclassid = 'pg_class'::regclass
				AND d.deptype IN ('a', 'i')), '')
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_sequence s ON s.seqrelid = c.oid
		WHERE n.nspname = $1 AND c.relkind = 'S' AND `+fmt.Sprintf(notExt, "c.oid")+` ORDER BY c.relname`, schema)
	if len(seqs) > 0 {
		b.WriteString("\n")
	}
	for _, s := range seqs {
		line := fmt.Sprintf("CREATE SEQUENCE %s AS %s START %s INCREMENT %s MINVALUE %s MAXVALUE %s CACHE %s",
			s[0], s[1], s[2], s[3], s[4], s[5], s[6])
		if s[7] == "true" {
			line += " CYCLE"
		}
		line += ";"
		if s[8] != "" {
			line += " -- owned by " + s[8]
		}
		b.WriteString(line + "\n")
	}

	for _, v := range rows(`SELECT quote_ident(c.relname), c.relkind::text, pg_get_viewdef(c.oid, true)
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relkind IN ('v', 'm') AND `+fmt.Sprintf(notExt, "c.oid")+` ORDER BY c.relname`, schema) {
		kind := "VIEW"
		if v[1] == "m" {
			kind = "MATERIALIZED VIEW"
		}
		b.WriteString("\nCREATE " + kind + " " + v[0] + " AS\n" + strings.TrimRight(v[2], "\n") + "\n")
	}

	// Types of their own: not a table's row type, not an array type.
	for _, ty := range rows(`SELECT quote_ident(t.typname), t.typtype::text,
			CASE t.typtype WHEN 'e' THEN (SELECT string_agg(quote_literal(enumlabel), ', ' ORDER BY enumsortorder) FROM pg_enum WHERE enumtypid = t.oid)
			               WHEN 'd' THEN format_type(t.typbasetype, t.typtypmod) || CASE WHEN t.typnotnull THEN ' NOT NULL' ELSE '' END
			                             || coalesce(' DEFAULT ' || t.typdefault, '')
			                             || coalesce((SELECT string_agg(' CONSTRAINT ' || quote_ident(conname) || ' ' || pg_get_constraintdef(oid, true), '' ORDER BY conname)
			                                          FROM pg_constraint WHERE contypid = t.oid), '')
			               ELSE '' END
		FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
		WHERE n.nspname = $1 AND `+fmt.Sprintf(notExt, "t.oid")+`
		AND (t.typrelid = 0 OR (SELECT relkind FROM pg_class WHERE oid = t.typrelid) = 'c')
		AND NOT EXISTS (SELECT 1 FROM pg_type e WHERE e.typarray = t.oid)
		ORDER BY t.typname`, schema) {
		switch ty[1] {
		case "e":
			b.WriteString("\nCREATE TYPE " + ty[0] + " AS ENUM (" + ty[2] + ");\n")
		case "d":
			b.WriteString("\nCREATE DOMAIN " + ty[0] + " AS " + ty[2] + ";\n")
		default:
			b.WriteString("\n-- OTHER type " + ty[0] + " (typtype " + ty[1] + ")\n")
		}
	}

	for _, f := range rows(`SELECT p.prokind::text, f.sig,
			CASE WHEN p.prokind IN ('f', 'p', 'w') THEN pg_get_functiondef(p.oid) ELSE '' END
		FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace,
		LATERAL (SELECT quote_ident(p.proname) || '(' || pg_get_function_identity_arguments(p.oid) || ')' AS sig) f
		WHERE n.nspname = $1 AND `+fmt.Sprintf(notExt, "p.oid")+` ORDER BY f.sig COLLATE "C"`, schema) {
		if f[2] == "" {
			b.WriteString("\n-- OTHER function " + f[1] + " (prokind " + f[0] + ")\n")
			continue
		}
		b.WriteString("\n" + strings.TrimRight(f[2], "\n") + ";\n")
	}

	for _, o := range rows(`SELECT quote_ident(c.relname), c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relkind NOT IN ('r', 'p', 'i', 'I', 'S', 'v', 'm', 't', 'c') AND `+fmt.Sprintf(notExt, "c.oid")+`
		ORDER BY c.relname`, schema) {
		b.WriteString("\n-- OTHER relation " + o[0] + " (relkind " + o[1] + ")\n")
	}
	return unqualify(b.String(), rows("SELECT quote_ident($1)", schema)[0][0])
}

// unqualify drops the schema (quoted as PostgreSQL quotes it) from the
// names PostgreSQL writes qualified (an index's table, a function's name):
// the text does not depend on the schema it was read from.
func unqualify(text, quoted string) string {
	return regexp.MustCompile(`(^|[^A-Za-z0-9_$."])`+regexp.QuoteMeta(quoted+".")).ReplaceAllString(text, "$1")
}

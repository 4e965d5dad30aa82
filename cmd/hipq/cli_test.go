package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"gopkg.in/yaml.v3"

	"github.com/hipq/hipq/internal/pgtest"
)

func TestCheckConfig(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	writeFile(t, good, `
database: {url: "postgres://hipq:hunter2hunter2@db/hipq"}
kafka: {brokers: [k:9092], sasl: {mechanism: PLAIN, username: u, password: "${KPASS}"}}
`)
	t.Setenv("KPASS", "kafka-secret-pw")
	var out, errOut bytes.Buffer
	if code := runMain([]string{"check-config", "--config", good}, &out, &errOut); code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	for _, secret := range []string{"hunter2hunter2", "kafka-secret-pw"} {
		if strings.Contains(out.String(), secret) {
			t.Errorf("check-config printed a secret:\n%s", out.String())
		}
	}
	if !strings.Contains(out.String(), "group: hipq-intake") {
		t.Errorf("effective config lacks defaults:\n%s", out.String())
	}
	bad := filepath.Join(dir, "bad.yaml")
	writeFile(t, bad, "database: {}\nkafka: {brokers: []}\nbogus: 1\n")
	out.Reset()
	errOut.Reset()
	if code := runMain([]string{"check-config", "--config", bad}, &out, &errOut); code != 2 {
		t.Fatalf("exit %d, want 2", code)
	}
	if !strings.Contains(errOut.String(), "bogus: unknown key") {
		t.Errorf("problems not reported:\n%s", errOut.String())
	}
}

// check-config --database refuses a config that gives a job type another
// queue while the type has non-final jobs in its old one (on Citus, one
// non-final job per type and key holds per queue only), naming the field,
// the type, the queues and the count; once those jobs ended, it passes.
func TestCheckConfigRefusesMovingATypeWithNonFinalJobs(t *testing.T) {
	ctx := context.Background()
	dbURL := pgtest.URL(t)
	cfgPath := filepath.Join(t.TempDir(), "hipq.yaml")
	writeFile(t, cfgPath, `
database: {url: "`+dbURL+`"}
kafka: {brokers: ["localhost:9092"]}
queues: [{name: old}, {name: new}]
job_types:
  - {name: a, queue: new, transport: {kafka: {topic: a}}}
  - {name: b, queue: old, transport: {kafka: {topic: b}}}
  - {name: c, queue: new, transport: {kafka: {topic: c}}}
`)
	db, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close(ctx)
	if _, err := db.Exec(ctx, `INSERT INTO hipq_job (queue, job_type, job_key, state, outcome) VALUES
		('old', 'a', '1', 'initial', NULL), ('old', 'a', '2', 'initial', NULL), ('older', 'a', '3', 'initial', NULL),
		('old', 'a', '4', 'final', 'succeeded'), ('new', 'a', '5', 'initial', NULL),
		('old', 'b', '1', 'initial', NULL), ('old', 'c', '1', 'initial', NULL)`); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	if code := runMain([]string{"check-config", "--config", cfgPath}, &out, &errOut); code != 0 {
		t.Fatalf("without --database: exit %d: %s", code, errOut.String())
	}
	if code := runMain([]string{"check-config", "--config", cfgPath, "--database"}, &out, &errOut); code != 2 {
		t.Fatalf("exit %d, want 2: %s", code, errOut.String())
	}
	for _, want := range []string{
		`job_types[0].queue: "new", but 3 non-final jobs of type a are in queues "old" (2), "older" (1): let them end (or cancel them) before changing the type's queue`,
		`job_types[2].queue: "new", but 1 non-final job of type c is in queue "old": let them end`,
	} {
		if !strings.Contains(errOut.String(), want) {
			t.Errorf("check-config --database said:\n%s\nwant a line with:\n%s", errOut.String(), want)
		}
	}
	if strings.Contains(errOut.String(), "type b") {
		t.Errorf("check-config --database refused type b, which stays in its queue:\n%s", errOut.String())
	}
	if _, err := db.Exec(ctx, `UPDATE hipq_job SET state = 'final', outcome = 'cancelled' WHERE queue <> 'new' AND job_type IN ('a', 'c')`); err != nil {
		t.Fatal(err)
	}
	errOut.Reset()
	if code := runMain([]string{"check-config", "--config", cfgPath, "--database"}, &out, &errOut); code != 0 {
		t.Fatalf("with the moved types' jobs ended: exit %d: %s", code, errOut.String())
	}
}

func TestMigrateCommand(t *testing.T) {
	e := newEnv(t)
	cfgPath := filepath.Join(t.TempDir(), "hipq.yaml")
	writeFile(t, cfgPath, e.configText(`{database: {url: "{{DB}}", schema: other}, kafka: {brokers: [x:1]}}`))
	var out, errOut bytes.Buffer
	for i, want := range []string{"applied 0001_init\n", "schema is up to date"} {
		out.Reset()
		if code := runMain([]string{"migrate", "--config", cfgPath}, &out, &errOut); code != 0 || !strings.Contains(out.String(), want) {
			t.Fatalf("migrate #%d: exit %d, out %q, err %q", i+1, code, out.String(), errOut.String())
		}
		if i == 0 && !strings.HasSuffix(out.String(), "applied repeatable hipq_intake_notify\n") {
			t.Fatalf("migrate does not end with the repeatable migrations: %q", out.String())
		}
	}
	out.Reset()
	if code := runMain([]string{"migrate", "status", "--config", cfgPath}, &out, &errOut); code != 0 ||
		!strings.Contains(out.String(), "0001_init  applied") || !strings.Contains(out.String(), "repeatable hipq_intake_notify  applied") {
		t.Fatalf("status: exit %d, out %q", code, out.String())
	}
	if code := runMain([]string{"run", "--config", cfgPath, "--only", "bogus"}, &out, &errOut); code != 2 {
		t.Fatalf("unknown role: exit %d, want 2", code)
	}
}

// The config docker-compose.yml runs must stay valid, with the
// environment the compose file gives hipq; so must the Citus example's
// (deploy/citus), where it says database.citus on.
func TestExampleConfigIsValid(t *testing.T) {
	for _, c := range []struct{ name, file, citus string }{
		{"single", "../../docker-compose.yml", "auto"},
		{"citus", "../../deploy/citus/docker-compose.yml", "on"},
	} {
		file, citus := c.file, c.citus
		t.Run(c.name, func(t *testing.T) {
			raw, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			var compose struct {
				Services map[string]struct {
					Environment map[string]string `yaml:"environment"`
					Volumes     []string          `yaml:"volumes"`
				} `yaml:"services"`
			}
			if err := yaml.Unmarshal(raw, &compose); err != nil {
				t.Fatal(err)
			}
			hipq := compose.Services["hipq"]
			if len(hipq.Environment) == 0 {
				t.Fatalf("%s: no environment for the hipq service", file)
			}
			if len(hipq.Volumes) != 1 || !strings.HasSuffix(hipq.Volumes[0], "examples/hipq.yaml:/etc/hipq/hipq.yaml:ro") {
				t.Fatalf("%s: the hipq service mounts %v, want examples/hipq.yaml", file, hipq.Volumes)
			}
			for k, v := range hipq.Environment {
				// ${VAR:-default} as compose resolves it with VAR unset.
				if m := regexp.MustCompile(`^\$\{\w+:-(.*)\}$`).FindStringSubmatch(v); m != nil {
					v = m[1]
				}
				t.Setenv(k, v)
			}
			var out, errOut bytes.Buffer
			if code := runMain([]string{"check-config", "--config", "../../examples/hipq.yaml"}, &out, &errOut); code != 0 {
				t.Fatalf("examples/hipq.yaml: exit %d: %s", code, errOut.String())
			}
			cfg, err := loadConfig("../../examples/hipq.yaml")
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Database.Citus != citus {
				t.Fatalf("%s: database.citus %q, want %q", file, cfg.Database.Citus, citus)
			}
		})
	}
}

// From trying the CLI by hand: `hipq version` and `hipq --version` print
// the version and what it was built from.
func TestVersion(t *testing.T) {
	for _, arg := range []string{"version", "--version"} {
		var out, errOut bytes.Buffer
		if code := runMain([]string{arg}, &out, &errOut); code != 0 {
			t.Fatalf("%s: exit %d: %s", arg, code, errOut.String())
		}
		if !regexp.MustCompile(`(?m)^hipq \S+\n(.|\n)*^go: go1\.\d+`).MatchString(out.String()) {
			t.Fatalf("%s printed:\n%s", arg, out.String())
		}
	}
}

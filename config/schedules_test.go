package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Every problem of a schedule is reported with its field's path; a valid
// one is compiled with its defaults.
func TestSchedulesConfig(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "amount.json"), []byte(`{"type": "object", "required": ["amount"]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	base := minimal + `
queues: [{name: default}]
job_types:
  - {name: report, transport: {kafka: {topic: r}}}
  - {name: invoice, transport: {kafka: {topic: r}}, data_schema: amount.json}
schedules:
`
	loadCfg := func(text string) (*Config, error) {
		t.Helper()
		p := filepath.Join(dir, "hipq.yaml")
		if err := os.WriteFile(p, []byte(strings.ReplaceAll(base+text, "${DB_URL}", "postgres://x")), 0o644); err != nil {
			t.Fatal(err)
		}
		return Load(p)
	}
	load := func(text string) error {
		t.Helper()
		_, err := loadCfg(text)
		return err
	}
	if err := load(`  - {name: daily, cron: "@daily", job_type: report, job_key: 'd-{{.Time.Format "2006-01-02"}}', job_data: {a: [1, 2]}}`); err != nil {
		t.Fatalf("a valid schedule: %v", err)
	}
	cfg, err := loadCfg(`  - {name: daily, cron: "0 3 * * *", tz: Europe/Berlin, job_type: report, job_key: k, job_data: {a: 1}}`)
	if err != nil {
		t.Fatal(err)
	}
	if s := cfg.PeriodicJobs(); len(s) != 1 || s[0].CatchUp != "latest" || s[0].Overlap != "allow" || s[0].CatchUpWindow.Hours() != 24 ||
		string(s[0].JobData) != `{"a":1}` || s[0].Zone.String() != "Europe/Berlin" {
		t.Errorf("compiled: %+v", s)
	}
	for text, want := range map[string]string{
		`  - {name: a, cron: "@daily", job_type: report, job_key: k}
  - {name: a, cron: "@daily", job_type: report, job_key: k}`: "schedules[1].name",
		`  - {name: a, cron: "@daily", job_type: nope, job_key: k}`:                        "schedules[0].job_type",
		`  - {name: a, cron: "@daily", tz: Mars/Olympus, job_type: report, job_key: k}`:    "schedules[0].tz",
		`  - {name: a, cron: "every day", job_type: report, job_key: k}`:                   "schedules[0].cron",
		`  - {name: a, cron: "@daily", job_type: report, job_key: '{{.Nope}}'}`:            "schedules[0].job_key",
		`  - {name: a, cron: "@daily", job_type: report}`:                                  "schedules[0].job_key",
		`  - {name: a, cron: "@daily", job_type: report, job_key: k, catch_up: sometimes}`: "schedules[0].catch_up",
		`  - {name: a, cron: "@daily", job_type: report, job_key: k, overlap: no}`:         "schedules[0].overlap",
		`  - {name: a, cron: "@daily", job_type: invoice, job_key: k, job_data: {b: 1}}`:   "schedules[0].job_data",
		`  - {name: "a b", cron: "@daily", job_type: report, job_key: k}`:                  "schedules[0].name",
	} {
		if err := load(text); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s:\n%v, want a problem at %s", text, err, want)
		}
	}
}

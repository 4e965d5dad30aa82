package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// data_schema is read relative to the config file's folder and compiled
// when the config is loaded: the job type checks job_data with it, and a
// broken schema is a config error naming the field.
func TestDataSchemaConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("schemas/invoice.json", `{"type": "object", "required": ["amount"]}`)
	write("schemas/broken.json", `{"type": 7}`)
	cfgText := `
database: {url: "postgres://db/hipq"}
kafka: {brokers: ["localhost:9092"]}
job_types:
  - name: invoice
    transport: {kafka: {topic: invoices}}
    data_schema: schemas/invoice.json
`
	cfg, err := Load(write("hipq.yaml", cfgText))
	if err != nil {
		t.Fatal(err)
	}
	jt := cfg.Domain()["invoice"]
	if jt.CheckData == nil {
		t.Fatal("the job type has no data check")
	}
	if err := jt.CheckData([]byte(`{"amount": 1}`)); err != nil {
		t.Errorf("valid data refused: %v", err)
	}
	if err := jt.CheckData([]byte(`{}`)); err == nil || !strings.Contains(err.Error(), "required") {
		t.Errorf("invalid data: %v", err)
	}

	_, err = Load(write("broken.yaml", strings.Replace(cfgText, "invoice.json", "broken.json", 1)))
	var errs Errors
	if !errors.As(err, &errs) || len(errs) != 1 || errs[0].Path != "job_types[0].data_schema" {
		t.Fatalf("broken schema: %v, want one problem at job_types[0].data_schema", err)
	}
	_, err = Load(write("missing.yaml", strings.Replace(cfgText, "invoice.json", "nope.json", 1)))
	if !errors.As(err, &errs) || errs[0].Path != "job_types[0].data_schema" || !strings.Contains(err.Error(), "nope.json") {
		t.Fatalf("missing schema: %v", err)
	}
}

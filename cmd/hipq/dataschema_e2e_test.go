package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/testutil"
)

// A job type's data_schema holds on every intake path: a Kafka record, an
// outbox row and an API call with valid job_data make jobs; with invalid
// job_data the record and the row are dead letters, and the API answers
// 400, each naming the failing JSON pointer and keyword.
func TestDataSchemaOnEveryIntakePath(t *testing.T) {
	t.Parallel()
	schema := filepath.Join(t.TempDir(), "e2e.schema.json")
	if err := os.WriteFile(schema, []byte(`{"type": "object", "required": ["amount"],
		"properties": {"amount": {"type": "integer", "minimum": 1}}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, e2eTopics...)
	text, url := withAPI(t, e2eConfig, "")
	text = strings.Replace(text, "    timeout: 2s\n", fmt.Sprintf("    timeout: 2s\n    data_schema: %q\n", schema), 1)
	a := e.start(e.config(text), "intake", "api")

	req := func(key, data string) string {
		return fmt.Sprintf(`{"job_type":"e2e","job_key":%q,"job_data":%s}`, key, data)
	}
	e.produce("jobs", req("kafka-ok", `{"amount": 2}`), req("kafka-bad", `{"amount": 0}`))
	if err := a.st.OutboxWrite(context.Background(), []string{req("outbox-ok", `{"amount": 3}`), req("outbox-bad", `{"amount": "3"}`)}); err != nil {
		t.Fatal(err)
	}
	waitAPI(t, url)
	put := func(key, body string) (int, string) {
		r, _ := http.NewRequest(http.MethodPut, url+"/v1/jobs/e2e/"+key, strings.NewReader(body))
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := put("api-ok", `{"job_data": {"amount": 4}}`); code != http.StatusCreated {
		t.Fatalf("valid API enqueue: %d %s", code, body)
	}
	if code, body := put("api-bad", `{"job_data": {}}`); code != http.StatusBadRequest ||
		!strings.Contains(body, "schema_violation") || !strings.Contains(body, "required") {
		t.Fatalf("invalid API enqueue: %d %s, want 400 schema_violation naming the keyword", code, body)
	}

	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(a, "job_key IN ('kafka-ok', 'outbox-ok', 'api-ok')")
		return n == 3, fmt.Sprintf("%d of 3", n)
	}, "the valid jobs")
	if n := e.countJobs(a, "job_key LIKE '%-bad'"); n != 0 {
		t.Fatalf("%d invalid jobs accepted", n)
	}
	want := map[string]string{"intake": `"/amount" fails minimum`, "outbox": `"/amount" fails type`}
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		rows, err := a.st.Pool().Query(context.Background(), `SELECT source, reason FROM hipq_dead_letter`)
		if err != nil {
			return false, err.Error()
		}
		defer rows.Close()
		got := map[string]string{}
		for rows.Next() {
			var src, reason string
			if err := rows.Scan(&src, &reason); err != nil {
				return false, err.Error()
			}
			got[src] = reason
		}
		for src, frag := range want {
			if !strings.HasPrefix(got[src], "schema_violation: ") || !strings.Contains(got[src], frag) {
				return false, fmt.Sprintf("%v", got)
			}
		}
		return len(got) == 2, fmt.Sprintf("%v", got)
	}, "the dead letters")
}

// check-config compiles every data_schema and names the field of a broken
// one.
func TestCheckConfigCompilesDataSchemas(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "broken.json"), []byte(`{"type": "objekt"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "hipq.yaml")
	if err := os.WriteFile(cfg, []byte(`
database: {url: "postgres://db/hipq"}
kafka: {brokers: ["localhost:9092"]}
job_types:
  - {name: a, transport: {kafka: {topic: a}}, data_schema: broken.json}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	err := cmdCheckConfig([]string{"--config", cfg}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "job_types[0].data_schema") || !strings.Contains(err.Error(), "broken.json") {
		t.Fatalf("check-config: %v, want the problem at job_types[0].data_schema", err)
	}
}

package schemas_test

import (
	"encoding/json"
	"io/fs"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/schemas"
)

// The request schema and the intake decoder must agree on the fields.
func TestRequestSchemaMatchesDecoder(t *testing.T) {
	b, err := fs.ReadFile(schemas.JSON, "json/request.schema.json")
	if err != nil {
		t.Fatal(err)
	}
	var s struct {
		Required   []string                   `json:"required"`
		Properties map[string]json.RawMessage `json:"properties"`
	}
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	var fromSchema, fromDecoder []string
	for k := range s.Properties {
		fromSchema = append(fromSchema, k)
	}
	rt := reflect.TypeOf(correlator.Request{})
	for i := range rt.NumField() {
		name, _, _ := strings.Cut(rt.Field(i).Tag.Get("json"), ",")
		fromDecoder = append(fromDecoder, name)
	}
	sort.Strings(fromSchema)
	sort.Strings(fromDecoder)
	if !reflect.DeepEqual(fromSchema, fromDecoder) {
		t.Fatalf("schema fields %v, decoder fields %v", fromSchema, fromDecoder)
	}
	if strings.Join(s.Required, ",") != "job_type,job_key" {
		t.Fatalf("required %v", s.Required)
	}
}

func TestSchemasAreJSON(t *testing.T) {
	entries, _ := fs.ReadDir(schemas.JSON, "json")
	if len(entries) < 3 {
		t.Fatalf("%d schemas", len(entries))
	}
	for _, e := range entries {
		b, _ := fs.ReadFile(schemas.JSON, "json/"+e.Name())
		if !json.Valid(b) {
			t.Errorf("%s is not valid JSON", e.Name())
		}
	}
}

package schemas

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeSchema(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "data.schema.json")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// A data_schema names the failing value's pointer and keyword; a schema
// that is not JSON, not a schema, or refers to a remote URL does not
// compile.
func TestDataSchema(t *testing.T) {
	s, err := CompileDataSchema(writeSchema(t, `{
		"type": "object", "required": ["amount"],
		"properties": {"amount": {"type": "integer", "minimum": 1},
		               "lines": {"type": "array", "items": {"type": "object", "required": ["sku"]}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Check([]byte(`{"amount": 3, "lines": [{"sku": "a/b"}]}`)); err != nil {
		t.Fatalf("valid data refused: %v", err)
	}
	for _, c := range []struct{ data, pointer, keyword string }{
		{`{"amount": 0}`, "/amount", "minimum"},
		{`{"amount": "3"}`, "/amount", "type"},
		{`{}`, "", "required"},
		{`{"amount": 1, "lines": [{"sku": "x"}, {}]}`, "/lines/1", "required"},
		{`null`, "", "type"},
	} {
		err := s.Check([]byte(c.data))
		var v *Violation
		if !errors.As(err, &v) || v.Pointer != c.pointer || v.Keyword != c.keyword || v.Message == "" {
			t.Errorf("%s: %#v (%v), want pointer %q keyword %q", c.data, v, err, c.pointer, c.keyword)
		}
	}
	for name, text := range map[string]string{
		"not JSON":   `{"type": `,
		"not schema": `{"type": 5}`,
		"remote ref": `{"$ref": "https://example.com/s.json"}`,
	} {
		if _, err := CompileDataSchema(writeSchema(t, text)); err == nil {
			t.Errorf("%s: compiled", name)
		}
	}
	if _, err := CompileDataSchema(filepath.Join(t.TempDir(), "missing.json")); err == nil || !strings.Contains(err.Error(), "missing.json") {
		t.Errorf("missing file: %v", err)
	}
}

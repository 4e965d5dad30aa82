package schemas

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
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

// A violation's text names the pointer, the keyword and what the schema
// expects, and never quotes the failing value: the reason of a dead
// letter, the hipq-error header, API errors and the dashboard all show
// it. Each keyword is tried with many random secrets.
func TestViolationNeverEchoesTheValue(t *testing.T) {
	draft7 := `"$schema": "http://json-schema.org/draft-07/schema#", `
	for _, c := range []struct {
		name, schema string
		data         string // %s: the secret
		num          bool   // the secret is a number
		pointer, kw  string
		want         string // in the text: the schema's expectation
	}{
		{"pattern", `{"properties": {"card": {"type": "string", "pattern": "^[0-9]{16}$"}}}`, `{"card": "%s"}`, false, "/card", "pattern", "^[0-9]{16}$"},
		{"enum", `{"properties": {"c": {"enum": ["red", "green"]}}}`, `{"c": "%s"}`, false, "/c", "enum", `'red', 'green'`},
		{"enum of one", `{"properties": {"c": {"enum": [1]}}}`, `{"c": "%s"}`, false, "/c", "enum", "1"},
		{"const", `{"properties": {"c": {"const": "yes"}}}`, `{"c": "%s"}`, false, "/c", "const", "'yes'"},
		{"format", `{` + draft7 + `"properties": {"e": {"format": "email"}}}`, `{"e": "%s"}`, false, "/e", "format", "email"},
		{"format ipv4", `{` + draft7 + `"properties": {"e": {"format": "ipv4"}}}`, `{"e": "%s"}`, false, "/e", "format", "ipv4"},
		{"minLength", `{"properties": {"p": {"minLength": 100}}}`, `{"p": "%s"}`, false, "/p", "minLength", "100"},
		{"maxLength", `{"properties": {"p": {"maxLength": 3}}}`, `{"p": "%s"}`, false, "/p", "maxLength", "3"},
		{"type", `{"properties": {"n": {"type": "integer"}}}`, `{"n": "%s"}`, false, "/n", "type", "integer"},
		{"minimum", `{"properties": {"n": {"minimum": 1000000000}}}`, `{"n": %s}`, true, "/n", "minimum", "1000000000"},
		{"maximum", `{"properties": {"n": {"maximum": 10}}}`, `{"n": %s}`, true, "/n", "maximum", "10"},
		{"exclusiveMaximum", `{"properties": {"n": {"exclusiveMaximum": 10.5}}}`, `{"n": %s}`, true, "/n", "exclusiveMaximum", "10.5"},
		{"exclusiveMinimum", `{"properties": {"n": {"exclusiveMinimum": 1000000000}}}`, `{"n": %s}`, true, "/n", "exclusiveMinimum", "1000000000"},
		{"multipleOf", `{"properties": {"n": {"multipleOf": 1000000007}}}`, `{"n": %s}`, true, "/n", "multipleOf", "1000000007"},
		{"propertyNames", `{"propertyNames": {"pattern": "^[0-9]+$"}}`, `{"%s": 1}`, false, "", "propertyNames", "property name"},
		{"not", `{"properties": {"c": {"not": {"type": "string"}}}}`, `{"c": "%s"}`, false, "/c", "not", "not"},
		{"anyOf", `{"properties": {"c": {"anyOf": [{"pattern": "^[0-9]+$"}, {"type": "number"}]}}}`, `{"c": "%s"}`, false, "/c", "pattern", "^[0-9]+$"},
		{"uniqueItems", `{"properties": {"l": {"uniqueItems": true}}}`, `{"l": ["%s", "%[1]s"]}`, false, "/l", "uniqueItems", "0 and 1"},
		{"nested", `{"properties": {"l": {"items": {"properties": {"pin": {"pattern": "^x$"}}}}}}`, `{"l": [{"pin": "x"}, {"pin": "%s"}]}`, false, "/l/1/pin", "pattern", "^x$"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := CompileDataSchema(writeSchema(t, c.schema))
			if err != nil {
				t.Fatal(err)
			}
			for range 200 {
				secret := randomSecret(c.num)
				err := s.Check(fmt.Appendf(nil, c.data, secret))
				var v *Violation
				if !errors.As(err, &v) {
					t.Fatalf("%q passed, want a violation (%v)", secret, err)
				}
				if v.Pointer != c.pointer || v.Keyword != c.kw || !strings.Contains(v.Message, c.want) {
					t.Fatalf("got pointer %q keyword %q message %q, want pointer %q keyword %q and a message naming %q",
						v.Pointer, v.Keyword, v.Message, c.pointer, c.kw, c.want)
				}
				if text := err.Error(); strings.Contains(text, secret) {
					t.Fatalf("the violation quotes the value %q: %s", secret, text)
				}
			}
		})
	}
}

// randomSecret is a value that passes none of the schemas above by
// accident: a card-number-like text of letters, digits and spaces, or a
// number of at least five digits that is no multiple of 1000000007.
func randomSecret(num bool) string {
	if num {
		return strconv.Itoa(10000 + rand.IntN(1e8))
	}
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "
	b := make([]byte, 8+rand.IntN(24))
	for i := range b {
		b[i] = alphabet[rand.IntN(len(alphabet))]
	}
	b[0] = 'S' // neither a digit nor a space, never all digits, never a list's first item
	return string(b)
}

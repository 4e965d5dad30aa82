package schemas

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"golang.org/x/text/language"
	"golang.org/x/text/message"
)

// DataSchema is a job type's data_schema: a JSON Schema (draft 2020-12
// unless its $schema names another) that every job's job_data must
// satisfy at intake. It is compiled once, when the config is read.
type DataSchema struct {
	path   string
	schema *jsonschema.Schema
}

// CompileDataSchema reads and compiles the schema file at path. Only
// files are loaded: a $ref to a remote URL is an error, never a download.
func CompileDataSchema(path string) (*DataSchema, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	c := jsonschema.NewCompiler()
	c.DefaultDraft(jsonschema.Draft2020)
	c.UseLoader(jsonschema.SchemeURLLoader{"file": jsonschema.FileLoader{}})
	s, err := c.Compile(abs)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &DataSchema{path: path, schema: s}, nil
}

// Violation says where job_data fails its schema: the JSON pointer of the
// failing value within job_data ("" is job_data itself), the schema
// keyword that fails, and why.
type Violation struct {
	Pointer string
	Keyword string
	Message string
}

func (v *Violation) Error() string {
	return fmt.Sprintf("job_data at %q fails %s: %s", v.Pointer, v.Keyword, v.Message)
}

var english = message.NewPrinter(language.English)

// Check validates data (JSON text). A failure is a *Violation naming the
// first failing value, deepest first.
func (d *DataSchema) Check(data []byte) error {
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
	if err != nil {
		return &Violation{Keyword: "type", Message: "not JSON: " + err.Error()}
	}
	err = d.schema.Validate(v)
	var ve *jsonschema.ValidationError
	if err == nil || !errors.As(err, &ve) {
		return err
	}
	leaf := ve
	for len(leaf.Causes) > 0 {
		leaf = leaf.Causes[0]
	}
	kw := "schema"
	if p := leaf.ErrorKind.KeywordPath(); len(p) > 0 {
		kw = p[len(p)-1]
	}
	return &Violation{Pointer: pointer(leaf.InstanceLocation), Keyword: kw, Message: leaf.ErrorKind.LocalizedString(english)}
}

// pointer is the RFC 6901 JSON pointer of a location.
func pointer(loc []string) string {
	var b strings.Builder
	for _, tok := range loc {
		b.WriteByte('/')
		b.WriteString(strings.ReplaceAll(strings.ReplaceAll(tok, "~", "~0"), "/", "~1"))
	}
	return b.String()
}

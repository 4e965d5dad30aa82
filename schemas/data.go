package schemas

import (
	"bytes"
	"errors"
	"fmt"
	"math/big"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"github.com/santhosh-tekuri/jsonschema/v6/kind"
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
// keyword that fails, and what the schema expects there. It never quotes
// the failing value: job_data may hold secrets (a card number failing a
// pattern), and the violation's text is a dead letter's reason, the
// hipq-error header and an API error, which people without access to the
// data read.
type Violation struct {
	Pointer string
	Keyword string
	Message string
}

func (v *Violation) Error() string {
	return fmt.Sprintf("job_data at %q fails %s: %s", v.Pointer, v.Keyword, v.Message)
}

// Check validates data (JSON text). A failure is a *Violation naming the
// first failing value, deepest first.
func (d *DataSchema) Check(data []byte) error {
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
	if err != nil {
		// The decoder's error may quote a piece of the text.
		return &Violation{Keyword: "type", Message: "not JSON"}
	}
	err = d.schema.Validate(v)
	var ve *jsonschema.ValidationError
	if err == nil || !errors.As(err, &ve) {
		return err
	}
	// The first cause, deepest first; a property name failing
	// propertyNames is reported on its object, where the name's own
	// failure would have no pointer.
	leaf := ve
	for len(leaf.Causes) > 0 {
		if _, ok := leaf.ErrorKind.(*kind.PropertyNames); ok {
			break
		}
		leaf = leaf.Causes[0]
	}
	kw, msg := expectation(leaf.ErrorKind)
	return &Violation{Pointer: pointer(leaf.InstanceLocation), Keyword: kw, Message: msg}
}

// expectation is the keyword of a failure and what the schema expects,
// written here from the schema's side of each kind of failure only: the
// validator's own messages quote the value ("'4111 1111 1111 1111' does
// not match pattern …"), a format checker's error may too, and a kind
// not listed here says no more than its keyword.
func expectation(k jsonschema.ErrorKind) (keyword, message string) {
	keyword = "schema"
	if p := k.KeywordPath(); len(p) > 0 {
		keyword = p[0]
	}
	switch k := k.(type) {
	case *kind.Type:
		// The value's JSON type, not the value.
		return keyword, fmt.Sprintf("got %s, want %s", k.Got, strings.Join(k.Want, " or "))
	case *kind.Enum:
		return keyword, "must be " + oneOf(k.Want)
	case *kind.Const:
		return keyword, "must be " + oneOf([]any{k.Want})
	case *kind.Format:
		return keyword, "must be a valid " + k.Want
	case *kind.Pattern:
		return keyword, "must match " + quote(k.Want)
	case *kind.MinLength:
		return keyword, fmt.Sprintf("must be at least %d characters long", k.Want)
	case *kind.MaxLength:
		return keyword, fmt.Sprintf("must be at most %d characters long", k.Want)
	case *kind.Minimum:
		return keyword, "must be at least " + number(k.Want)
	case *kind.Maximum:
		return keyword, "must be at most " + number(k.Want)
	case *kind.ExclusiveMinimum:
		return keyword, "must be more than " + number(k.Want)
	case *kind.ExclusiveMaximum:
		return keyword, "must be less than " + number(k.Want)
	case *kind.MultipleOf:
		return keyword, "must be a multiple of " + number(k.Want)
	case *kind.MinProperties:
		return keyword, fmt.Sprintf("must have at least %d properties", k.Want)
	case *kind.MaxProperties:
		return keyword, fmt.Sprintf("must have at most %d properties", k.Want)
	case *kind.MinItems:
		return keyword, fmt.Sprintf("must have at least %d items", k.Want)
	case *kind.MaxItems:
		return keyword, fmt.Sprintf("must have at most %d items", k.Want)
	case *kind.AdditionalItems:
		return keyword, fmt.Sprintf("the last %d items are not allowed", k.Count)
	case *kind.Required:
		// Names from the schema.
		if len(k.Missing) == 1 {
			return keyword, "missing property " + quote(k.Missing[0])
		}
		return keyword, "missing properties " + quoteAll(k.Missing)
	case *kind.Dependency:
		return keyword, fmt.Sprintf("properties %s are required when %s is present", quoteAll(k.Missing), quote(k.Prop))
	case *kind.DependentRequired:
		return keyword, fmt.Sprintf("properties %s are required when %s is present", quoteAll(k.Missing), quote(k.Prop))
	case *kind.AdditionalProperties:
		// Property names, as the pointer shows them; not their values.
		if len(k.Properties) == 1 {
			return keyword, "property " + quote(k.Properties[0]) + " is not allowed"
		}
		return keyword, "properties " + quoteAll(k.Properties) + " are not allowed"
	case *kind.PropertyNames:
		// The name is what fails here: it is not repeated.
		return keyword, "a property name does not satisfy propertyNames"
	case *kind.UniqueItems:
		return keyword, fmt.Sprintf("items %d and %d are equal", k.Duplicates[0], k.Duplicates[1])
	case *kind.Contains:
		return keyword, "no item matches contains"
	case *kind.MinContains:
		return keyword, fmt.Sprintf("at least %d items must match contains", k.Want)
	case *kind.MaxContains:
		return keyword, fmt.Sprintf("at most %d items may match contains", k.Want)
	case *kind.ContentEncoding:
		return keyword, "must be encoded in " + k.Want
	case *kind.ContentMediaType:
		return keyword, "must be of media type " + k.Want
	case *kind.ContentSchema:
		return keyword, "the decoded content fails contentSchema"
	case *kind.OneOf:
		if len(k.Subschemas) == 0 {
			return keyword, "must match exactly one subschema, matches none"
		}
		return keyword, fmt.Sprintf("must match exactly one subschema, matches %d and %d", k.Subschemas[0], k.Subschemas[1])
	case *kind.AnyOf:
		return keyword, "must match at least one subschema"
	case *kind.AllOf:
		return keyword, "must match every subschema"
	case *kind.Not:
		return "not", "must not match the subschema"
	case *kind.FalseSchema:
		return "false", "no value is allowed here"
	}
	return keyword, "validation failed"
}

// oneOf is a list of the schema's allowed values: each scalar written
// out, an object or array only counted.
func oneOf(want []any) string {
	var out []string
	for _, w := range want {
		switch w := w.(type) {
		case string:
			out = append(out, quote(w))
		case []any, map[string]any:
			return fmt.Sprintf("one of the schema's %d values", len(want))
		default:
			out = append(out, fmt.Sprint(w))
		}
	}
	if len(out) == 1 {
		return out[0]
	}
	return "one of " + strings.Join(out, ", ")
}

// number writes a bound of the schema as plain decimal.
func number(r *big.Rat) string {
	if r.IsInt() {
		return r.Num().String()
	}
	f, _ := r.Float64()
	return strconv.FormatFloat(f, 'g', -1, 64)
}

// quote writes a text of the schema in single quotes, escaped as Go would.
func quote(s string) string {
	q := strconv.Quote(s)
	return "'" + strings.ReplaceAll(strings.ReplaceAll(q[1:len(q)-1], `\"`, `"`), "'", `\'`) + "'"
}

func quoteAll(names []string) string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = quote(n)
	}
	return strings.Join(out, ", ")
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

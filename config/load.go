package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/hipq/hipq/internal/memlimit"
)

// Problem is one thing wrong with a config: the field's path and why.
type Problem struct {
	Path   string
	Reason string
}

func (p Problem) String() string {
	if p.Path == "" {
		return p.Reason
	}
	return p.Path + ": " + p.Reason
}

// Errors is every problem found, reported at once.
type Errors []Problem

func (e Errors) Error() string {
	lines := make([]string, len(e))
	for i, p := range e {
		lines[i] = p.String()
	}
	return fmt.Sprintf("invalid config (%d problem(s)):\n  %s", len(e), strings.Join(lines, "\n  "))
}

// UnmarshalYAML reads "10s", "1h30m" or a bare number of seconds.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	// A *yaml.TypeError lets decoding go on and report every problem.
	bad := &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: %q is not a duration such as 10s or 1h30m", n.Line, n.Value)}}
	if n.Kind != yaml.ScalarNode {
		return bad
	}
	if secs, err := strconv.ParseFloat(n.Value, 64); err == nil {
		*d = Duration(secs * float64(time.Second))
		return nil
	}
	v, err := time.ParseDuration(n.Value)
	if err != nil {
		return bad
	}
	*d = Duration(v)
	return nil
}

// UnmarshalYAML reads a whole number of bytes, or a number with a unit
// (memlimit.ParseSize).
func (b *ByteSize) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: not a size such as 64MiB, 512MB or 1GiB", n.Line)}}
	}
	v, err := memlimit.ParseSize(n.Value)
	if err != nil {
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: %v", n.Line, err)}}
	}
	if v == 0 {
		// (0 would read as left out: resolved at start, never "no limit")
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: 0 is no limit hipq takes: leave memory_limit out to take GOMEMLIMIT's, the cgroup's or the default, or set a size", n.Line)}}
	}
	*b = ByteSize(v)
	return nil
}

// Load reads, expands, fills defaults and validates a config file.
func Load(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	return parse(string(b), os.LookupEnv, filepath.Dir(path))
}

var envRef = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}`)

// Parse is Load on text, with lookup for environment variables. Errors are
// Errors.
// Relative file paths in it (data_schema) are taken from the working
// directory.
func Parse(text string, lookup func(string) (string, bool)) (*Config, error) {
	return parse(text, lookup, "")
}

// parse is Parse with dir, the folder relative file paths start from.
func parse(text string, lookup func(string) (string, bool), dir string) (*Config, error) {
	if lookup == nil {
		lookup = func(string) (string, bool) { return "", false }
	}
	var root yaml.Node
	if err := yaml.Unmarshal([]byte(text), &root); err != nil {
		return nil, Errors{{Reason: "not valid YAML: " + err.Error()}}
	}
	var errs Errors
	lines := map[int]string{}
	cfg := &Config{dir: dir}
	if len(root.Content) > 0 {
		doc := root.Content[0]
		walk(doc, reflect.TypeOf(Config{}), "", lookup, lines, &errs)
		if err := doc.Decode(cfg); err != nil {
			var te *yaml.TypeError
			if errors.As(err, &te) {
				for _, msg := range te.Errors {
					errs = append(errs, typeProblem(msg, lines))
				}
			} else {
				errs = append(errs, Problem{Reason: err.Error()})
			}
		}
	}
	// The checks of what did decode run whatever went wrong above, so one
	// run names every problem; a field already reported (a bad duration, an
	// unset variable) is not reported again for the empty value it was left.
	cfg.fillDefaults()
	if err := cfg.Validate(); err != nil {
		var more Errors
		if !errors.As(err, &more) {
			return nil, append(errs, Problem{Reason: err.Error()})
		}
		seen := map[string]bool{}
		for _, p := range errs {
			seen[p.Path] = true
		}
		for _, p := range more {
			if !seen[p.Path] {
				errs = append(errs, p)
			}
		}
	}
	if len(errs) > 0 {
		return nil, errs
	}
	return cfg, nil
}

var lineMsg = regexp.MustCompile(`^line (\d+): (.*)$`)

func typeProblem(msg string, lines map[int]string) Problem {
	if m := lineMsg.FindStringSubmatch(msg); m != nil {
		n, _ := strconv.Atoi(m[1])
		reason := strings.Replace(m[2], "cannot unmarshal !!", "cannot read a ", 1)
		if p, ok := lines[n]; ok {
			return Problem{Path: p, Reason: reason}
		}
		return Problem{Path: "line " + m[1], Reason: reason}
	}
	return Problem{Reason: msg}
}

// walk expands ${VAR} in scalar values, rejects keys that name no field,
// and remembers each line's path for yaml's type errors.
func walk(n *yaml.Node, t reflect.Type, path string, lookup func(string) (string, bool), lines map[int]string, errs *Errors) {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if _, seen := lines[n.Line]; !seen && path != "" {
		lines[n.Line] = path
	}
	switch n.Kind {
	case yaml.ScalarNode:
		if v := expand(n.Value, path, lookup, errs); v != n.Value {
			// Resolve the expanded text afresh, so "${PORT}" can fill an int;
			// a string field still takes any scalar as text.
			n.Value, n.Tag, n.Style = v, "", 0
		}
	case yaml.SequenceNode:
		var et reflect.Type
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
			et = t.Elem()
		}
		for i, c := range n.Content {
			walk(c, et, fmt.Sprintf("%s[%d]", path, i), lookup, lines, errs)
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := k.Value
			if path != "" {
				p = path + "." + k.Value
			}
			lines[k.Line] = p
			var vt reflect.Type
			switch {
			case t == nil:
			case t.Kind() == reflect.Map:
				vt = t.Elem()
			case t.Kind() == reflect.Struct:
				f, ok := fieldByYAML(t, k.Value)
				if !ok {
					*errs = append(*errs, Problem{Path: p, Reason: "unknown key (known: " + strings.Join(yamlKeys(t), ", ") + ")"})
					continue
				}
				vt = f
			}
			walk(v, vt, p, lookup, lines, errs)
		}
	}
}

func expand(s, path string, lookup func(string) (string, bool), errs *Errors) string {
	return envRef.ReplaceAllStringFunc(s, func(ref string) string {
		m := envRef.FindStringSubmatch(ref)
		if v, ok := lookup(m[1]); ok && (v != "" || m[2] == "") {
			return v
		}
		if m[2] != "" {
			return m[3]
		}
		*errs = append(*errs, Problem{Path: path, Reason: fmt.Sprintf("environment variable %s is not set (use ${%s:-default} for a default)", m[1], m[1])})
		return ""
	})
}

// yamlFields maps a struct's YAML keys to field types, inline fields
// included.
func yamlFields(t reflect.Type, out map[string]reflect.Type) {
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if strings.Contains(opts, "inline") {
			yamlFields(f.Type, out)
			continue
		}
		if name == "-" {
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		out[name] = f.Type
	}
}

func fieldByYAML(t reflect.Type, key string) (reflect.Type, bool) {
	m := map[string]reflect.Type{}
	yamlFields(t, m)
	f, ok := m[key]
	return f, ok
}

func yamlKeys(t reflect.Type) []string {
	m := map[string]reflect.Type{}
	yamlFields(t, m)
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

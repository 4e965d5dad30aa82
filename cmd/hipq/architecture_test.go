package main

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The roles (intake and replies, dispatcher, sweeper, API) meet in the
// store, never in each other: cmd wires them. The domain (correlator)
// depends on no other package of hipq, and the store on the domain and
// the schemas only. A package's non-test files are read for their
// imports; tests may import what they like.
func TestRolesMeetInTheStore(t *testing.T) {
	const mod = "github.com/hipq/hipq/"
	roles := []string{"api", "consumer", "dispatcher", "sweeper"}
	rules := map[string][]string{ // package: the hipq packages it may not import
		"correlator": {"api", "consumer", "dispatcher", "sweeper", "store", "config", "schemas", "internal"},
		"store":      {"api", "consumer", "dispatcher", "sweeper", "config", "internal"},
	}
	for _, r := range roles {
		rules[r] = append(slices.DeleteFunc(slices.Clone(roles), func(o string) bool { return o == r }), "config")
	}
	for pkg, banned := range rules {
		dir := filepath.Join("..", "..", pkg)
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil || len(files) == 0 {
			t.Fatalf("%s: no Go files (%v)", dir, err)
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			ast, err := parser.ParseFile(token.NewFileSet(), f, src, parser.ImportsOnly)
			if err != nil {
				t.Fatal(err)
			}
			for _, imp := range ast.Imports {
				path, _ := strconv.Unquote(imp.Path.Value)
				rest, ok := strings.CutPrefix(path, mod)
				if !ok {
					continue
				}
				for _, b := range banned {
					if rest == b || strings.HasPrefix(rest, b+"/") {
						t.Errorf("%s imports %s: %s may not depend on %s", f, path, pkg, b)
					}
				}
			}
		}
	}
}

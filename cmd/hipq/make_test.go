package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// fuzzLine is the one shape of a line of the Makefile's fuzz target: one
// fuzzer of one package, by its anchored name (-fuzz takes a regular
// expression, and FuzzMatch alone would also match FuzzMatchMembers, which
// go test refuses), in the main module or, after "cd dir &&", another.
var fuzzLine = regexp.MustCompile(`^\t(?:cd (\S+) && )?\$\(GO\) test (\./\S*) -run '\^\$\$' -fuzz '\^(Fuzz\w*)\$\$' -fuzztime \$\(FUZZTIME\)$`)

// `make fuzz` runs every fuzzer of the repository, each on its own by its
// anchored name: a Fuzz function in any package's tests (the client's
// module too) that the fuzz target leaves out fails this test.
func TestMakeFuzzRunsEveryFuzzer(t *testing.T) {
	root := filepath.Join("..", "..")
	text, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	inMake := map[string]bool{}
	lines := strings.Split(string(text), "\n")
	start := slices.Index(lines, "fuzz:")
	if start < 0 {
		t.Fatal("the Makefile has no fuzz target")
	}
	for _, l := range lines[start+1:] {
		if !strings.HasPrefix(l, "\t") {
			break
		}
		m := fuzzLine.FindStringSubmatch(l)
		if m == nil {
			t.Errorf("fuzz target line %q is not `[cd DIR && ]$(GO) test ./PKG -run '^$$' -fuzz '^FuzzX$$' -fuzztime $(FUZZTIME)`", l)
			continue
		}
		key := path.Join(m[1], m[2]) + " " + m[3]
		if inMake[key] {
			t.Errorf("fuzz target runs %s twice", key)
		}
		inMake[key] = true
	}

	inRepo := map[string]bool{}
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); p != root && (strings.HasPrefix(n, ".") || strings.HasPrefix(n, "_") || n == "testdata" || n == "vendor") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, filepath.Dir(p))
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			if fn, ok := decl.(*ast.FuncDecl); ok && fn.Recv == nil && isFuzzer(fn) {
				inRepo[path.Join(filepath.ToSlash(rel))+" "+fn.Name.Name] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(inRepo) == 0 {
		t.Fatal("no fuzzer found in the repository")
	}
	for key := range inRepo {
		if !inMake[key] {
			t.Errorf("make fuzz does not run %s", key)
		}
	}
	for key := range inMake {
		if !inRepo[key] {
			t.Errorf("make fuzz runs %s, which is no fuzzer of the repository", key)
		}
	}
}

// isFuzzer: a function go test runs as a fuzz test, FuzzXxx(*testing.F).
func isFuzzer(fn *ast.FuncDecl) bool {
	name := fn.Name.Name
	if !strings.HasPrefix(name, "Fuzz") || (len(name) > 4 && name[4] >= 'a' && name[4] <= 'z') {
		return false
	}
	params := fn.Type.Params.List
	if len(params) != 1 || len(params[0].Names) > 1 {
		return false
	}
	star, ok := params[0].Type.(*ast.StarExpr)
	if !ok {
		return false
	}
	sel, ok := star.X.(*ast.SelectorExpr)
	return ok && sel.Sel.Name == "F"
}

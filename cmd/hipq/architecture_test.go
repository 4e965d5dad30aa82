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

// "Bounded" (a queue whose claims count running jobs: a throttle, per-type
// caps or rates) has one definition, correlator.Throttle.Bounded; no other
// Go file writes the rule again.
func TestBoundedIsDefinedOnce(t *testing.T) {
	found := goLines(t, func(line string) bool {
		return strings.Contains(line, "Limit >= 1 ||") && strings.Contains(line, "len(") && strings.Contains(line, "MaxConcurrency")
	})
	if len(found) != 1 || !strings.Contains(found[0], filepath.Join("correlator", "throttle.go")+":") {
		t.Errorf("the rule of a bounded queue is written at %v; it belongs in correlator.Throttle.Bounded alone", found)
	}
}

// A queue's order has one definition in Go, correlator.Order.Compare: no
// other Go file compares jobs by priority.
func TestQueueOrderIsDefinedOnce(t *testing.T) {
	found := goLines(t, func(line string) bool {
		return strings.Contains(line, "cmp.Compare(") && strings.Contains(line, "Priority")
	})
	if len(found) != 1 || !strings.Contains(found[0], filepath.Join("correlator", "order.go")+":") {
		t.Errorf("jobs are compared by priority at %v; the queue's order belongs in correlator.Order.Compare alone", found)
	}
}

// "Due" (waiting, its time come, not expired) has one definition in Go,
// correlator.Job.Due, and one in SQL, the store's dueTimeSQL (and dueSQL
// from it); "claimable at intake" one, correlator.Job.ClaimableAtIntake.
func TestDueIsDefinedOnce(t *testing.T) {
	for _, c := range []struct {
		what, home string
		match      func(string) bool
	}{
		{"a job's expiry judged in Go", filepath.Join("correlator", "jobtype.go"), func(l string) bool {
			return strings.Contains(l, "ExpiresAt.After(") || strings.Contains(l, "ExpiresAt.Before(")
		}},
		{"a due job's time judged in SQL", filepath.Join("store", "claim.go"), func(l string) bool {
			return strings.Contains(l, "scheduled_run_time <= now()")
		}},
		{"a job's own windows judged for a claim at intake", filepath.Join("correlator", "jobtype.go"), func(l string) bool {
			return strings.Contains(l, "TimeWindows == nil &&")
		}},
	} {
		found := goLines(t, c.match)
		if len(found) != 1 || !strings.Contains(found[0], c.home+":") {
			t.Errorf("%s at %v; it belongs in %s alone", c.what, found, c.home)
		}
	}
}

// goLines lists, as path:line, the lines of the repository's non-test Go
// files that match.
func goLines(t *testing.T, match func(line string) bool) []string {
	t.Helper()
	var found []string
	err := filepath.WalkDir(filepath.Join("..", ".."), func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for i, line := range strings.Split(string(src), "\n") {
			if match(line) {
				found = append(found, path+":"+strconv.Itoa(i+1))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}

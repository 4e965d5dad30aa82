package dispatcher

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
)

// reserve takes at most what is left of max and never goes past it;
// hold counts past it, and then reserve takes nothing until enough is
// released; what is released is available again.
func TestRoomReservesWithinMax(t *testing.T) {
	r := room{max: 10}
	for _, step := range []struct {
		name      string
		do        func() int
		want      int
		available int
	}{
		{"reserve 4", func() int { return r.reserve(4) }, 4, 6},
		{"reserve 10 of 6 left", func() int { return r.reserve(10) }, 6, 0},
		{"reserve when full", func() int { return r.reserve(1) }, 0, 0},
		{"release 3", func() int { r.release(3); return 0 }, 0, 3},
		{"reserve 0", func() int { return r.reserve(0) }, 0, 3},
		{"reserve -1", func() int { return r.reserve(-1) }, 0, 3},
		{"hold 5 past max", func() int { r.hold(5); return 0 }, 0, -2},
		{"reserve while held past max", func() int { return r.reserve(1) }, 0, -2},
		{"release the hold", func() int { r.release(5); return 0 }, 0, 3},
		{"release the rest", func() int { r.release(7); return 0 }, 0, 10},
		{"reserve all", func() int { return r.reserve(10) }, 10, 0},
	} {
		if got := step.do(); got != step.want {
			t.Fatalf("%s: took %d, want %d", step.name, got, step.want)
		}
		if got := r.available(); got != step.available {
			t.Fatalf("%s: %d available, want %d", step.name, got, step.available)
		}
	}
}

// Reserves and releases from many goroutines at once never hand out more
// than max together, never leave the count below zero, and give it all
// back in the end. Run it under -race: a reserve that reads the count and
// adds to it in two steps, instead of one compare-and-swap, hands out more
// than max here.
func TestRoomConcurrentReservesStayWithinMax(t *testing.T) {
	const limit, workers, rounds = 10, 8, 100000
	r := room{max: limit}
	var held atomic.Int64 // what reserve handed out and is not released yet
	var wg sync.WaitGroup
	errs := make(chan string, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds {
				k := r.reserve(1 + (w+i)%4)
				if h := held.Add(int64(k)); h > limit {
					errs <- "reserves hand out more than max together"
					return
				}
				if a := r.available(); a < 0 || a > limit {
					errs <- "the count left its bounds [0, max]"
					return
				}
				held.Add(-int64(k))
				r.release(k)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	if got := r.available(); got != limit {
		t.Errorf("%d available after every release, want %d", got, limit)
	}
}

// The count of jobs in flight has one owner, room (room.go): no other
// file of the package, tests included, declares, reads or writes its
// field; they reserve, hold, release and ask what is available through
// room's methods, so MaxInFlight is kept in one place.
func TestInFlightCountHasOneOwner(t *testing.T) {
	const owner, field = "room.go", "inflight"
	files, err := filepath.Glob("*.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("no Go files (%v)", err)
	}
	declared := false
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		fset := token.NewFileSet()
		file, err := parser.ParseFile(fset, f, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(file, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.TypeSpec:
				if st, ok := n.Type.(*ast.StructType); ok && n.Name.Name == "room" && f == owner {
					for _, fl := range st.Fields.List {
						for _, name := range fl.Names {
							declared = declared || name.Name == field
						}
					}
				}
			case *ast.Field:
				for _, name := range n.Names {
					if name.Name == field && f != owner {
						t.Errorf("%s declares a field %s: the count of jobs in flight belongs to room (%s) alone", fset.Position(name.Pos()), field, owner)
					}
				}
			case *ast.SelectorExpr:
				if n.Sel.Name == field && f != owner {
					t.Errorf("%s touches the count of jobs in flight (.%s); only %s may, through room's methods", fset.Position(n.Pos()), field, owner)
				}
			}
			return true
		})
	}
	if !declared {
		t.Errorf("%s declares no struct room with a field %s: the count's owner moved, and this test must follow it", owner, field)
	}
}

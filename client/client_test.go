package client

import (
	"os/exec"
	"strings"
	"testing"
)

// The client module is the standard library only: a producer's build pulls
// in none of hipq's server dependencies.
func TestStandardLibraryOnly(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	if deps := strings.Fields(string(out)); len(deps) != 1 || deps[0] != "github.com/hipq/hipq/client" {
		t.Fatalf("non-standard dependencies: %v", deps)
	}
}

func TestErrorField(t *testing.T) {
	e := &Error{Status: 400, Code: "too_large", Message: "job_key: 20480 bytes is more than the limit of 1024"}
	if e.Field() != "job_key" || !isInvalid(e) {
		t.Fatalf("field %q", e.Field())
	}
}

func isInvalid(err error) bool {
	e, ok := err.(*Error)
	return ok && e.Is(ErrInvalid)
}

package client

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
)

// A producer's build pulls in none of hipq's server dependencies: client
// and sqloutbox are the standard library only, pgxoutbox adds pgx,
// kafkaintake franz-go.
func TestDependencies(t *testing.T) {
	for pkg, allowed := range map[string][]string{
		".":             nil,
		"./sqloutbox":   nil,
		"./pgxoutbox":   {"github.com/jackc/", "golang.org/x/text/"},
		"./kafkaintake": {"github.com/twmb/franz-go/", "github.com/klauspost/compress", "github.com/pierrec/lz4/"},
	} {
		out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list: %v\n%s", err, out)
		}
	deps:
		for _, d := range strings.Fields(string(out)) {
			if d == "github.com/hipq/hipq/client" || strings.HasPrefix(d, "github.com/hipq/hipq/client/") {
				continue
			}
			for _, a := range allowed {
				if strings.HasPrefix(d, a) {
					continue deps
				}
			}
			t.Errorf("%s depends on %s", pkg, d)
		}
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

func TestIntakeJSON(t *testing.T) {
	p := 5
	b, err := Job{Type: "invoice.ship", Key: "shp_1", Data: json.RawMessage(`{"n":1}`), Priority: &p}.IntakeJSON()
	if err != nil || string(b) != `{"job_type":"invoice.ship","job_key":"shp_1","job_data":{"n":1},"priority":5}` {
		t.Fatalf("%s %v", b, err)
	}
}

// Package examplehipq lets the client module's examples run against a live
// hipq. The server module's TestClientExamples (part of `make test`)
// starts one, on a throwaway PostgreSQL and an embedded Kafka, and runs the
// examples with its coordinates in HIPQ_EXAMPLE_* variables; without them
// the examples are skipped, saying so, and the tests run.
package examplehipq

import (
	"flag"
	"fmt"
	"os"
	"testing"
)

// Main runs a package's tests, and its examples when a hipq is given.
func Main(m *testing.M) {
	flag.Parse()
	if os.Getenv("HIPQ_EXAMPLE_API_URL") == "" && flag.Lookup("test.run").Value.String() == "" {
		fmt.Fprintln(os.Stderr, "examples skipped: they run against a live hipq, which the server module's "+
			"TestClientExamples (part of `make test`) starts and names in HIPQ_EXAMPLE_* variables")
		_ = flag.Set("test.run", "^Test")
	}
	os.Exit(m.Run())
}

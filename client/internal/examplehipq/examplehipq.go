// Package examplehipq lets the client module's examples run against a live
// hipq. The server module's TestClientExamples (part of `make test`)
// starts one, on a throwaway PostgreSQL and an embedded Kafka, and runs the
// examples with its coordinates in HIPQ_EXAMPLE_* variables; without them
// the examples are skipped, saying so, and the tests run.
package examplehipq

import (
	"flag"
	"fmt"
	"net/http"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// Main runs a package's tests, and its examples when a hipq is given, and
// then fails the run if a goroutine they started is still running
// (goleak): a test or an example must stop what it starts.
func Main(m *testing.M) {
	flag.Parse()
	if os.Getenv("HIPQ_EXAMPLE_API_URL") == "" && flag.Lookup("test.run").Value.String() == "" {
		fmt.Fprintln(os.Stderr, "examples skipped: they run against a live hipq, which the server module's "+
			"TestClientExamples (part of `make test`) starts and names in HIPQ_EXAMPLE_* variables")
		_ = flag.Set("test.run", "^Test")
	}
	code := m.Run()
	if code == 0 {
		// The examples' calls go through http.DefaultClient, whose idle
		// connections to the live hipq stay open for the next call, each
		// with its two goroutines: they are the pool's, not a leak.
		http.DefaultClient.CloseIdleConnections()
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: goroutines left running after the tests passed: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

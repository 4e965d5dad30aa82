package tracing

import (
	"testing"

	"go.uber.org/goleak"
)

// The exporter's batch processor runs a goroutine until Shutdown: the run
// fails if a test leaves one (or any other) running.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

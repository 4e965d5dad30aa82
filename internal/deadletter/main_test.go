package deadletter_test

import (
	"testing"

	"go.uber.org/goleak"
)

// A copy runs on its client's goroutines: the run fails if a test leaves
// one running.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

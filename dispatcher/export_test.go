package dispatcher

// ClassifyCallError is classifyCallError, for the tests of package
// dispatcher_test.
var ClassifyCallError = classifyCallError

// PeakDrains is the most topics the relay drained at once.
func (r *Relay) PeakDrains() int64 { return r.peakDrains.Load() }

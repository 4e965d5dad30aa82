package dispatcher

// ClassifyCallError is classifyCallError, for the tests of package
// dispatcher_test.
var ClassifyCallError = classifyCallError

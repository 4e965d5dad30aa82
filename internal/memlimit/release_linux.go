package memlimit

import "syscall"

// release drops s's pages from the process (MADV_DONTNEED): for a
// read-only mapping of a file, the next touch maps the file's page again.
func release(s span) bool {
	_, _, errno := syscall.Syscall(syscall.SYS_MADVISE, s.start, s.end-s.start, syscall.MADV_DONTNEED)
	return errno == 0
}

package localcitus

import "testing"

// A node's URL is the coordinator's with the node's host and port and the
// database asked for; user, password and the other parameters stay.
func TestNodeURL(t *testing.T) {
	for base, want := range map[string]string{
		"postgres://u:p%40ss@coord:5432/postgres?sslmode=disable&host=other&port=1": "postgres://u:p%40ss@10.0.0.2:6432/d%20b?sslmode=disable",
		"postgresql://u@[::1]:5432/x":                                  "postgresql://u@10.0.0.2:6432/d%20b",
		"host=/tmp port=5432 user=u password='it\\'s' dbname=postgres": "host=/tmp port=5432 user=u password='it\\'s' dbname=postgres host='10.0.0.2' port=6432 dbname='d b'",
	} {
		if got := nodeURL(base, "10.0.0.2", 6432)("d b"); got != want {
			t.Errorf("nodeURL(%q):\n got %s\nwant %s", base, got, want)
		}
	}
	if got := nodeURL("user=u", "h", 1)(`o'k\`); got != `user=u host='h' port=1 dbname='o\'k\\'` {
		t.Errorf("a quoted database name: %s", got)
	}
}

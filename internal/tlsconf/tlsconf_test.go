package tlsconf_test

import (
	"bytes"
	"crypto/tls"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/certtest"
	"github.com/hipq/hipq/internal/tlsconf"
)

// put copies a pair's files to cert and key, dated at (a rotation writes
// new files; their times, not their sizes, must tell them apart).
func put(t *testing.T, p certtest.Pair, cert, key string, at time.Time) {
	t.Helper()
	for from, to := range map[string]string{p.CertFile: cert, p.KeyFile: key} {
		b, err := os.ReadFile(from)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(to, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(to, at, at); err != nil {
			t.Fatal(err)
		}
	}
}

// A server's certificate is read again once its files change; a pair
// that cannot be read then (the key not written yet) leaves the last good
// one in use, reported once, until it can.
func TestServerCertificateRotation(t *testing.T) {
	ca := certtest.NewCA(t, "test")
	a, b := ca.Server(t, "a", "127.0.0.1"), ca.Server(t, "b", "127.0.0.1")
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	now := time.Now()
	put(t, a, cert, key, now.Add(-time.Hour))
	var reloads []error
	tc, err := tlsconf.Server(tlsconf.Files{CertFile: cert, KeyFile: key, Reloaded: func(err error) { reloads = append(reloads, err) }})
	if err != nil {
		t.Fatal(err)
	}
	serving := func() []byte {
		t.Helper()
		c, err := tc.GetCertificate(&tls.ClientHelloInfo{})
		if err != nil {
			t.Fatal(err)
		}
		return c.Certificate[0]
	}
	if !bytes.Equal(serving(), a.TLS.Certificate[0]) || len(reloads) != 0 {
		t.Fatalf("not serving the first certificate (reloads %v)", reloads)
	}
	put(t, b, cert, key, now)
	if !bytes.Equal(serving(), b.TLS.Certificate[0]) || len(reloads) != 1 || reloads[0] != nil {
		t.Fatalf("not serving the rotated certificate (reloads %v)", reloads)
	}
	// Half a rotation: a's certificate with b's key.
	c := ca.Server(t, "c", "127.0.0.1")
	put(t, c, cert, key, now.Add(time.Minute))
	put(t, certtest.Pair{CertFile: c.CertFile, KeyFile: b.KeyFile}, cert, key, now.Add(time.Minute))
	for range 3 {
		if !bytes.Equal(serving(), b.TLS.Certificate[0]) {
			t.Fatal("a certificate without its key replaced the last good one")
		}
	}
	var fe *tlsconf.Field
	if len(reloads) != 2 || !errors.As(reloads[1], &fe) || fe.Key != "cert_file" {
		t.Fatalf("the failed reading is reported once, naming cert_file: %v", reloads)
	}
	put(t, c, cert, key, now.Add(2*time.Minute))
	if !bytes.Equal(serving(), c.TLS.Certificate[0]) || len(reloads) != 3 || reloads[2] != nil {
		t.Fatalf("not serving the mended certificate (reloads %v)", reloads)
	}
}

// A rotation that first removes the files, then writes a pair that does
// not go together, reports both, each once: the missing file, then the
// pair that cannot be read.
func TestRotationFailuresAreEachReported(t *testing.T) {
	ca := certtest.NewCA(t, "test")
	a, b := ca.Server(t, "a", "127.0.0.1"), ca.Server(t, "b", "127.0.0.1")
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	now := time.Now()
	put(t, a, cert, key, now.Add(-time.Hour))
	var reloads []error
	tc, err := tlsconf.Server(tlsconf.Files{CertFile: cert, KeyFile: key, Reloaded: func(err error) { reloads = append(reloads, err) }})
	if err != nil {
		t.Fatal(err)
	}
	hello := func() {
		t.Helper()
		if _, err := tc.GetCertificate(&tls.ClientHelloInfo{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Remove(key); err != nil {
		t.Fatal(err)
	}
	hello()
	hello()
	put(t, certtest.Pair{CertFile: b.CertFile, KeyFile: a.KeyFile}, cert, key, now)
	hello()
	hello()
	if len(reloads) != 2 || reloads[0] == nil || reloads[1] == nil || reloads[0].Error() == reloads[1].Error() {
		t.Fatalf("reports %v, want the missing key, then the pair that does not go together", reloads)
	}
}

// Errors name the key of the file at fault.
func TestFilesErrors(t *testing.T) {
	ca := certtest.NewCA(t, "test")
	p := ca.Client(t, "x")
	for _, c := range []struct {
		f    tlsconf.Files
		want string
	}{
		{tlsconf.Files{CAFile: "/nowhere"}, "ca_file"},
		{tlsconf.Files{CAFile: p.KeyFile}, "ca_file"},
		{tlsconf.Files{CertFile: p.CertFile}, "key_file"},
		{tlsconf.Files{KeyFile: p.KeyFile}, "cert_file"},
		{tlsconf.Files{CertFile: "/nowhere", KeyFile: p.KeyFile}, "cert_file"},
		{tlsconf.Files{CertFile: p.CertFile, KeyFile: ca.File}, "cert_file"},
	} {
		_, err := tlsconf.Client(c.f)
		var fe *tlsconf.Field
		if !errors.As(err, &fe) || fe.Key != c.want {
			t.Errorf("%+v: %v, want an error about %s", c.f, err, c.want)
		}
	}
}

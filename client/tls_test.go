package client

import (
	"context"
	"crypto/tls"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// WithCAFile trusts the API's certificate of a private CA; without it the
// client refuses the server and Wait gives up at once; a CA file that
// cannot be read fails every call, saying so.
func TestWithCAFile(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"error": {"code": "not_found", "message": "no job"}}`))
	}))
	defer srv.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, _, err := New(srv.URL, WithCAFile(ca)).Get(ctx, "t", "k"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("with the CA: %v, want the API's not found", err)
	}
	// WithHTTPClient's settings stay; its transport is replaced.
	if _, _, err := New(srv.URL, WithHTTPClient(&http.Client{Timeout: 5 * time.Second}), WithCAFile(ca)).Get(ctx, "t", "k"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("with an HTTP client and the CA: %v", err)
	}
	var unverified *tls.CertificateVerificationError
	if _, err := New(srv.URL).Wait(ctx, Ref{Type: "t", Key: "k"}); !errors.As(err, &unverified) {
		t.Fatalf("without the CA: %v, want a certificate verification error, at once", err)
	}
	_, _, err := New(srv.URL, WithCAFile(filepath.Join(t.TempDir(), "missing.pem"))).Get(ctx, "t", "k")
	if err == nil || !strings.Contains(err.Error(), "CA file") {
		t.Fatalf("a missing CA file: %v", err)
	}
	if _, err := New(srv.URL, WithCAFile(filepath.Join(t.TempDir(), "missing.pem"))).Wait(ctx, Ref{Type: "t", Key: "k"}); err == nil {
		t.Fatal("Wait with a missing CA file returned no error")
	}
}

package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hipq/hipq/client"
	"github.com/hipq/hipq/internal/certtest"
	"github.com/hipq/hipq/internal/testutil"
)

// copyPair writes a pair's files to cert and key, dated at: a rotation
// writes new files (their times tell them apart, whatever their sizes).
func copyPair(t *testing.T, p certtest.Pair, cert, key string, at time.Time) {
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

// The API over HTTPS (api.tls) with a certificate of a private CA: an
// HTTPS downstream of another private CA, demanding mutual TLS, gets its
// request (transport.http.tls), and its heartbeat and callback reach the
// API at the https public_url; the Go client (WithCAFile) enqueues and waits, the CLI
// (--ca-file) reads the job, and neither trusts the API without the CA; a
// certificate rotated on disk is served from the next connection on,
// without a restart.
func TestAPIOverTLS(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "jobs")
	ca := certtest.NewCA(t, "api")
	first, second := ca.Server(t, "api-1", "127.0.0.1"), ca.Server(t, "api-2", "127.0.0.1")
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	copyPair(t, first, certFile, keyFile, time.Now().Add(-time.Hour))
	trusting := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool()}}, Timeout: 10 * time.Second}

	// The downstream: HTTPS with a certificate of its own private CA,
	// demanding hipq's client certificate (transport.http.tls).
	dsCA, clientCA := certtest.NewCA(t, "downstream"), certtest.NewCA(t, "clients")
	hipqCert := clientCA.Client(t, "hipq")
	heartbeats := make(chan string, 4)
	downstream := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.TLS.PeerCertificates) == 0 || r.TLS.PeerCertificates[0].Subject.CommonName != "hipq" {
			w.WriteHeader(http.StatusForbidden)
			return
		}
		hb, cb := r.Header.Get("Hipq-Heartbeat-Url"), r.Header.Get("Hipq-Callback-Url")
		w.WriteHeader(http.StatusAccepted)
		go func() { // the work runs later: news on the heartbeat URL, then the reply on the callback URL
			resp, err := trusting.Post(hb, "application/json", strings.NewReader(`{"done": 0.5}`))
			if err != nil {
				heartbeats <- err.Error()
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			heartbeats <- fmt.Sprintf("%s %d %s", hb[:8], resp.StatusCode, bytes.TrimSpace(b))
			resp, err = trusting.Post(cb, "application/json", strings.NewReader(`{"status": "succeeded", "result": {"label": "L-1"}}`))
			if err != nil {
				t.Errorf("callback: %v", err)
				return
			}
			resp.Body.Close()
		}()
	}))
	downstream.TLS = dsCA.ServerTLS(t, []string{"127.0.0.1"}, clientCA)
	downstream.StartTLS()
	defer downstream.Close()
	addr, token := freeAddr(t), strings.Repeat("T", 32)
	cfg := e.config(fmt.Sprintf(`
name: web
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"]}
intake: {topics: ["{{T:jobs}}"]}
dispatch: {interval: 100ms}
api: {listen: "%s", tls: {cert_file: %q, key_file: %q}, tokens: ["%s"], callback_secret: "%s"}
job_types:
  - name: label.print
    transport: {http: {url: "%s/labels/{job_key}", timeout: 5s, mode: async,
                       tls: {ca_file: %q, cert_file: %q, key_file: %q}}}
    timeout: 1m
`, addr, certFile, keyFile, token, strings.Repeat("S", 32), downstream.URL, dsCA.File, hipqCert.CertFile, hipqCert.KeyFile))
	base := "https://" + addr
	if cfg.API.PublicURL != base {
		t.Fatalf("public_url defaults to %q with api.tls, want %q", cfg.API.PublicURL, base)
	}
	e.start(cfg)
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		resp, err := trusting.Get(base + "/healthz")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return true, ""
	}, "the API over HTTPS")
	// Served with the first certificate.
	served := func() string {
		t.Helper()
		conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: ca.Pool()})
		if err != nil {
			t.Fatalf("TLS to the API: %v", err)
		}
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0].Subject.CommonName
	}
	if cn := served(); cn != "api-1" {
		t.Fatalf("serving %q, want api-1", cn)
	}

	// The Go client: with the CA it enqueues and waits; without, it fails at
	// once (a certificate it does not trust is not worth waiting on).
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := client.New(base, client.WithToken(token), client.WithCAFile(ca.File))
	row, created, err := c.Enqueue(ctx, client.Job{Type: "label.print", Key: "p1", Data: json.RawMessage(`{"sku": 7}`)})
	if err != nil || !created {
		t.Fatalf("enqueue over HTTPS: %v (created %v)", err, created)
	}
	final, err := c.Wait(ctx, row.Ref())
	if err != nil || final.Outcome == nil || *final.Outcome != "succeeded" || !strings.Contains(string(final.Result), "L-1") {
		t.Fatalf("job: %+v %v", final, err)
	}
	if hb := <-heartbeats; !strings.HasPrefix(hb, `https:// 200 {"accepted":true`) {
		t.Fatalf("heartbeat over HTTPS: %s", hb)
	}
	var unverified *tls.CertificateVerificationError
	if _, err := client.New(base, client.WithToken(token)).Wait(ctx, row.Ref()); !errors.As(err, &unverified) {
		t.Fatalf("a client without the CA: %v, want a certificate verification error", err)
	}
	if _, _, err := client.New(base, client.WithCAFile(filepath.Join(dir, "nowhere.pem"))).Get(ctx, "label.print", "p1"); err == nil ||
		!strings.Contains(err.Error(), "CA file") {
		t.Fatalf("a client with a missing CA file: %v", err)
	}

	// The CLI: --ca-file, or $HIPQ_API_CA_FILE.
	var out, errOut bytes.Buffer
	if code := runMain([]string{"jobs", "get", "label.print", "p1", "--server", base, "--token", token, "--ca-file", ca.File}, &out, &errOut); code != 0 ||
		!strings.Contains(out.String(), "succeeded") {
		t.Fatalf("hipq jobs get --ca-file: exit %d\n%s%s", code, out.String(), errOut.String())
	}
	out.Reset()
	errOut.Reset()
	if code := runMain([]string{"jobs", "get", "label.print", "p1", "--server", base, "--token", token}, &out, &errOut); code != 1 ||
		!strings.Contains(errOut.String(), "cannot trust the hipq API") || !strings.Contains(errOut.String(), "--ca-file") {
		t.Fatalf("hipq jobs get without the CA: exit %d\n%s%s", code, out.String(), errOut.String())
	}

	// Rotation: new files, served from the next connection on.
	copyPair(t, second, certFile, keyFile, time.Now())
	if cn := served(); cn != "api-2" {
		t.Fatalf("after the rotation serving %q, want api-2", cn)
	}
	resp, err := trusting.Get(base + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/readyz over HTTPS after the rotation: %d", resp.StatusCode)
	}
}

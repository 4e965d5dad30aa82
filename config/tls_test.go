package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hipq/hipq/internal/certtest"
)

// TLS sections are read as hipq will read them: a missing file, a CA file
// without a certificate or a key that is not the certificate's is a
// problem naming its key; relative paths start at the config's folder.
func TestTLSFiles(t *testing.T) {
	ca := certtest.NewCA(t, "test")
	pair := ca.Client(t, "hipq")
	other := ca.Client(t, "other")
	server := ca.Server(t, "api", "localhost")
	secret := strings.Repeat("s", 32)
	dir := t.TempDir()
	junk := filepath.Join(dir, "junk.pem")
	if err := os.WriteFile(junk, []byte("not PEM"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Relative to the config's folder: copies of the CA next to it.
	b, _ := os.ReadFile(ca.File)
	if err := os.WriteFile(filepath.Join(dir, "ca.pem"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, yaml string
		problems   []string // path: reason fragments; none: valid
	}{
		{"kafka: CA, server name and client certificate",
			`kafka: {brokers: [b:9093], tls: {enabled: true, ca_file: ` + ca.File + `, server_name: kafka.internal, cert_file: ` + pair.CertFile + `, key_file: ` + pair.KeyFile + `}}`, nil},
		{"kafka: a CA file relative to the config's folder",
			`kafka: {brokers: [b:9093], tls: {enabled: true, ca_file: ca.pem}}`, nil},
		{"kafka: files without enabled",
			`kafka: {brokers: [b:9093], tls: {server_name: kafka.internal}}`, []string{"kafka.tls.enabled: ca_file, server_name"}},
		{"kafka: a missing CA file",
			`kafka: {brokers: [b:9093], tls: {enabled: true, ca_file: /nowhere/ca.pem}}`, []string{"kafka.tls.ca_file: open /nowhere/ca.pem"}},
		{"kafka: a CA file without a certificate",
			`kafka: {brokers: [b:9093], tls: {enabled: true, ca_file: ` + junk + `}}`, []string{"kafka.tls.ca_file: no PEM certificate"}},
		{"kafka: a certificate without its key",
			`kafka: {brokers: [b:9093], tls: {enabled: true, cert_file: ` + pair.CertFile + `}}`, []string{"kafka.tls.key_file: is required with cert_file"}},
		{"kafka: a key that is not the certificate's",
			`kafka: {brokers: [b:9093], tls: {enabled: true, cert_file: ` + pair.CertFile + `, key_file: ` + other.KeyFile + `}}`,
			[]string{"kafka.tls.cert_file: " + pair.CertFile + " with key_file " + other.KeyFile}},
		{"api: a certificate and its key",
			`api: {callback_secret: ` + secret + `, tls: {cert_file: ` + server.CertFile + `, key_file: ` + server.KeyFile + `}}`, nil},
		{"api: no key",
			`api: {callback_secret: ` + secret + `, tls: {cert_file: ` + server.CertFile + `}}`, []string{"api.tls.key_file: is required with cert_file"}},
		{"api: a missing certificate",
			`api: {callback_secret: ` + secret + `, tls: {cert_file: /nowhere.pem, key_file: ` + server.KeyFile + `}}`, []string{"api.tls.cert_file: stat /nowhere.pem"}},
		{"http transport: a CA and a client certificate",
			httpType(`url: "https://svc/x", tls: {ca_file: ` + ca.File + `, cert_file: ` + pair.CertFile + `, key_file: ` + pair.KeyFile + `}`), nil},
		{"http transport: tls for an http url",
			httpType(`url: "http://svc/x", tls: {ca_file: ` + ca.File + `}`), []string{`job_types[0].transport.http.tls: is set but the url "http://svc/x" is not https`}},
		{"http transport: an empty tls",
			httpType(`url: "https://svc/x", tls: {}`), []string{"job_types[0].transport.http.tls: is empty"}},
		{"http transport: a CA file without a certificate",
			httpType(`url: "https://svc/x", tls: {ca_file: ` + junk + `}`), []string{"job_types[0].transport.http.tls.ca_file: no PEM certificate"}},
		{"http transport: a key without its certificate",
			httpType(`url: "https://svc/x", tls: {key_file: ` + pair.KeyFile + `}`), []string{"job_types[0].transport.http.tls.cert_file: is required with key_file"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if !strings.HasPrefix(c.yaml, "kafka:") {
				c.yaml = "kafka: {brokers: [b:9092]}\n" + c.yaml
			}
			_, err := parse("database: {url: x}\n"+c.yaml+"\n", nil, dir)
			var errs Errors
			if len(c.problems) == 0 {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if !errors.As(err, &errs) {
				t.Fatalf("got %v, want problems %q", err, c.problems)
			}
			for _, want := range c.problems {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("problems:\n%v\nwant one with %q", err, want)
				}
			}
		})
	}
}

// With api.tls, callback URLs start with https:// unless public_url says
// otherwise.
func TestAPIPublicURLWithTLS(t *testing.T) {
	ca := certtest.NewCA(t, "test")
	p := ca.Server(t, "api", "localhost")
	cfg, err := Parse(minimal+"api: {listen: \"0.0.0.0:8443\", callback_secret: "+strings.Repeat("s", 32)+
		", tls: {cert_file: "+p.CertFile+", key_file: "+p.KeyFile+"}}\n", env(map[string]string{"DB_URL": "x"}))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.API.PublicURL != "https://0.0.0.0:8443" {
		t.Errorf("public_url = %q, want https://0.0.0.0:8443", cfg.API.PublicURL)
	}
}

// httpType is a config with one sync HTTP job type whose transport.http
// holds keys.
func httpType(keys string) string {
	return "job_types: [{name: t, transport: {http: {mode: sync, " + keys + "}}}]"
}

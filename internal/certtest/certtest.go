// Package certtest gives tests a private certificate authority: a CA made
// afresh for each test, the server and client certificates it signs, and
// their PEM files, so that TLS is tested against certificates no system
// trusts. No product code uses it.
package certtest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// CA is a certificate authority that lives as long as its test.
type CA struct {
	Cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// File is the CA certificate as a PEM file (a ca_file, sslrootcert).
	File string
	dir  string
}

var serial atomic.Int64

// NewCA makes a CA named name, its files in a temporary folder of t's.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(serial.Add(1)),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatalf("certtest: CA certificate: %v", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatalf("certtest: %v", err)
	}
	ca := &CA{Cert: cert, key: key, dir: t.TempDir()}
	ca.File = ca.write(t, name+"-ca.pem", pemBlock("CERTIFICATE", der))
	return ca
}

// Pool is a pool holding only the CA, for a client or server that trusts
// it.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Pair is a certificate the CA signed, with its key: in memory and as
// PEM files.
type Pair struct {
	TLS      tls.Certificate
	CertFile string
	KeyFile  string
}

// Server signs a server certificate for hosts: DNS names or IP addresses.
func (ca *CA) Server(t testing.TB, name string, hosts ...string) Pair {
	t.Helper()
	tmpl := ca.leaf(name, x509.ExtKeyUsageServerAuth)
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	return ca.sign(t, name, tmpl)
}

// Client signs a client certificate whose common name is name (the user a
// server that maps certificates to users, such as PostgreSQL, sees).
func (ca *CA) Client(t testing.TB, name string) Pair {
	t.Helper()
	return ca.sign(t, name, ca.leaf(name, x509.ExtKeyUsageClientAuth))
}

// ServerTLS is a listener's config serving a certificate for hosts; with
// clientCAs, it demands a client certificate they signed.
func (ca *CA) ServerTLS(t testing.TB, hosts []string, clientCAs ...*CA) *tls.Config {
	t.Helper()
	c := &tls.Config{Certificates: []tls.Certificate{ca.Server(t, "server", hosts...).TLS}, MinVersion: tls.VersionTLS12}
	if len(clientCAs) > 0 {
		c.ClientCAs = x509.NewCertPool()
		for _, o := range clientCAs {
			c.ClientCAs.AddCert(o.Cert)
		}
		c.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return c
}

func (ca *CA) leaf(name string, usage x509.ExtKeyUsage) *x509.Certificate {
	return &x509.Certificate{
		SerialNumber: big.NewInt(serial.Add(1)),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
	}
}

func (ca *CA) sign(t testing.TB, name string, tmpl *x509.Certificate) Pair {
	t.Helper()
	key := newKey(t)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatalf("certtest: certificate %s: %v", name, err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatalf("certtest: %v", err)
	}
	certPEM, keyPEM := pemBlock("CERTIFICATE", der), pemBlock("PRIVATE KEY", keyDER)
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatalf("certtest: %v", err)
	}
	n := serial.Add(1)
	return Pair{TLS: pair, CertFile: ca.write(t, name+"-"+big.NewInt(n).String()+".pem", certPEM),
		KeyFile: ca.write(t, name+"-"+big.NewInt(n).String()+".key", keyPEM)}
}

func (ca *CA) write(t testing.TB, name string, b []byte) string {
	t.Helper()
	p := filepath.Join(ca.dir, name)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatalf("certtest: %v", err)
	}
	return p
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("certtest: key: %v", err)
	}
	return key
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

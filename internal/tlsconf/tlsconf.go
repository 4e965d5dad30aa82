// Package tlsconf builds hipq's TLS configurations from PEM files: a
// client's (the CA to trust, a client certificate for mutual TLS) and a
// server's. Certificates are read again when their files change, so a
// rotated certificate needs no restart; a CA file is read once.
package tlsconf

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
)

// Files names the PEM files of one TLS configuration.
type Files struct {
	// CAFile holds the certificates to trust; empty: the system's roots
	// (a client), or no client certificates asked for (a server).
	CAFile string
	// CertFile and KeyFile are this side's certificate and key; both or
	// neither.
	CertFile, KeyFile string
	// ServerName, for a client, is the name the server's certificate must
	// carry; empty: the host name dialled.
	ServerName string
	// Reloaded, when set, is told of each reading of the certificate
	// after the first, at the handshake that found its files changed: nil
	// once the new one is in use, else why it could not be read (the
	// last good one stays in use). It runs during that handshake.
	Reloaded func(error)
}

// Field is an error about one of the files: Key is its key in the
// config (ca_file, cert_file), so the caller can name the whole path.
type Field struct {
	Key string
	Err error
}

func (e *Field) Error() string { return e.Key + ": " + e.Err.Error() }
func (e *Field) Unwrap() error { return e.Err }

// Client is the TLS configuration of a client with f's files. Its client
// certificate is read again when its files change.
func Client(f Files) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: f.ServerName}
	if f.CAFile != "" {
		pool, err := Pool(f.CAFile)
		if err != nil {
			return nil, &Field{"ca_file", err}
		}
		tc.RootCAs = pool
	}
	if f.CertFile != "" || f.KeyFile != "" {
		kp, err := NewKeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			return nil, err
		}
		kp.reloaded = f.Reloaded
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return kp.Certificate() }
	}
	return tc, nil
}

// Server is the TLS configuration of a server with f's certificate, read
// again when its files change; with a CAFile, clients must present a
// certificate it signed.
func Server(f Files) (*tls.Config, error) {
	kp, err := NewKeyPair(f.CertFile, f.KeyFile)
	if err != nil {
		return nil, err
	}
	kp.reloaded = f.Reloaded
	tc := &tls.Config{MinVersion: tls.VersionTLS12,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return kp.Certificate() }}
	if f.CAFile != "" {
		pool, err := Pool(f.CAFile)
		if err != nil {
			return nil, &Field{"ca_file", err}
		}
		tc.ClientCAs, tc.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return tc, nil
}

// Pool reads a file of PEM certificates.
func Pool(file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("no PEM certificate in %s", file)
	}
	return pool, nil
}

// KeyPair is a certificate and its key, read from their files again when
// either file's modification time or size changes. A pair that cannot be
// read then (one file written, not yet the other) leaves the last good
// one in use, and is tried again at the next handshake.
type KeyPair struct {
	certFile, keyFile string
	reloaded          func(error)

	mu      sync.Mutex
	cert    *tls.Certificate
	stamp   [2]stamp // of certFile and keyFile when cert was read
	lastErr error
}

type stamp struct {
	mod  time.Time
	size int64
}

// NewKeyPair reads the pair once; an error names the file at fault.
func NewKeyPair(certFile, keyFile string) (*KeyPair, error) {
	switch {
	case certFile == "":
		return nil, &Field{"cert_file", errors.New("is required with key_file")}
	case keyFile == "":
		return nil, &Field{"key_file", errors.New("is required with cert_file")}
	}
	kp := &KeyPair{certFile: certFile, keyFile: keyFile}
	st, err := kp.stamps()
	if err != nil {
		return nil, err
	}
	if err := kp.load(st); err != nil {
		return nil, err
	}
	return kp, nil
}

func (kp *KeyPair) stamps() ([2]stamp, error) {
	var out [2]stamp
	for i, f := range []struct{ key, file string }{{"cert_file", kp.certFile}, {"key_file", kp.keyFile}} {
		fi, err := os.Stat(f.file)
		if err != nil {
			return out, &Field{f.key, err}
		}
		out[i] = stamp{fi.ModTime(), fi.Size()}
	}
	return out, nil
}

func (kp *KeyPair) load(st [2]stamp) error {
	c, err := tls.LoadX509KeyPair(kp.certFile, kp.keyFile)
	if err != nil {
		return &Field{"cert_file", fmt.Errorf("%s with key_file %s: %w", kp.certFile, kp.keyFile, err)}
	}
	kp.cert, kp.stamp = &c, st
	return nil
}

// Certificate is the pair, read again first if its files changed since.
func (kp *KeyPair) Certificate() (*tls.Certificate, error) {
	kp.mu.Lock()
	defer kp.mu.Unlock()
	st, err := kp.stamps()
	loaded := false
	if err == nil && st != kp.stamp {
		err = kp.load(st)
		loaded = err == nil
	}
	// A new pair served is said; so is each failure, once (not at every
	// handshake), whether the files could not be found or not be read.
	if kp.reloaded != nil && (loaded || err != nil && (kp.lastErr == nil || kp.lastErr.Error() != err.Error())) {
		kp.reloaded(err)
	}
	kp.lastErr = err
	return kp.cert, nil
}

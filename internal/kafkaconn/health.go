package kafkaconn

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// connections remembers, per broker address, why the last connection to
// it failed, so that a failed Ping can name the broker and the cause
// rather than the last error alone. Every client NewClient builds has one.
type connections struct {
	// sasl: the client signs in with SASL, so a broker that hangs up
	// during connection setup most likely refused the credentials (kfake
	// and some proxies hang up instead of answering
	// SASL_AUTHENTICATION_FAILED).
	sasl bool
	mu   sync.Mutex
	last map[string]error // by host:port; absent: the last connection worked
}

// OnBrokerConnect implements kgo.HookBrokerConnect: it runs after each
// dial and connection setup (TLS handshake, ApiVersions, SASL).
func (c *connections) OnBrokerConnect(meta kgo.BrokerMetadata, _ time.Duration, _ net.Conn, err error) {
	addr := net.JoinHostPort(meta.Host, strconv.Itoa(int(meta.Port)))
	c.mu.Lock()
	defer c.mu.Unlock()
	if err == nil {
		delete(c.last, addr)
		return
	}
	c.last[addr] = err
}

func (c *connections) failures() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for addr, err := range c.last {
		out = append(out, "broker "+addr+": "+cause(err, c.sasl))
	}
	slices.Sort(out)
	return out
}

// Ping asks the cluster for its brokers, as kgo.Client.Ping does. Failing,
// its error names each broker whose last connection failed and why (an
// untrusted certificate, a refused password), for readiness to show. It
// never holds a secret: neither franz-go's errors nor the brokers'
// answers carry the password.
func Ping(ctx context.Context, cl *kgo.Client) error {
	err := cl.Ping(ctx)
	if err == nil {
		return nil
	}
	conns := hookOf(cl)
	sasl := false
	if conns != nil {
		if f := conns.failures(); len(f) > 0 {
			return errors.New(strings.Join(f, "; "))
		}
		sasl = conns.sasl
	}
	seeds, _ := cl.OptValue(kgo.SeedBrokers).([]string)
	return fmt.Errorf("no broker answered (seed brokers %s): %s", strings.Join(seeds, ", "), cause(err, sasl))
}

// hookOf is the client's connections hook, nil for a client NewClient did
// not build. (franz-go hands its hooks back as a slice of its own type.)
func hookOf(cl *kgo.Client) *connections {
	for _, v := range cl.OptValues(kgo.WithHooks) {
		hs := reflect.ValueOf(v)
		if hs.Kind() != reflect.Slice {
			continue
		}
		for i := range hs.Len() {
			if c, ok := hs.Index(i).Interface().(*connections); ok {
				return c
			}
		}
	}
	return nil
}

// cause says why a connection to a broker failed, in words that point at
// the setting to look at, followed by the error itself. sasl: the client
// signs in with SASL.
func cause(err error, sasl bool) string {
	var (
		unknownCA x509.UnknownAuthorityError
		hostname  x509.HostnameError
		invalid   x509.CertificateInvalidError
		alert     tls.AlertError
		notTLS    tls.RecordHeaderError
		firstEOF  *kgo.ErrFirstReadEOF
		remote    *net.OpError
	)
	var why string
	switch {
	case errors.As(err, &unknownCA):
		why = "TLS: the broker's certificate is not signed by a trusted CA (kafka.tls.ca_file)"
	case errors.As(err, &hostname):
		why = "TLS: the broker's certificate is not for the name dialled (kafka.brokers, kafka.tls.server_name)"
	case errors.As(err, &invalid):
		why = "TLS: the broker's certificate is not valid (expired, or not for a server)"
	case errors.As(err, &alert), errors.As(err, &remote) && remote.Op == "remote error":
		why = "TLS: the broker refused the handshake, most often hipq's client certificate (kafka.tls.cert_file, key_file)"
	case errors.As(err, &notTLS):
		why = "TLS: the broker does not speak TLS on this port (kafka.tls.enabled)"
	case errors.As(err, &firstEOF):
		why = "the broker hung up at once (kafka.tls.enabled, kafka.sasl)"
	case sasl && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)):
		why = "SASL: authentication failed, most likely: the broker hung up while hipq signed in (kafka.sasl.username, password, mechanism; or the broker was restarting)"
	case errors.Is(err, kerr.SaslAuthenticationFailed):
		why = "SASL: authentication failed (kafka.sasl.username, password, mechanism)"
	case errors.Is(err, kerr.UnsupportedSaslMechanism), errors.Is(err, kerr.IllegalSaslState):
		why = "SASL: the broker does not accept this mechanism (kafka.sasl.mechanism)"
	case errors.Is(err, kerr.TopicAuthorizationFailed), errors.Is(err, kerr.GroupAuthorizationFailed),
		errors.Is(err, kerr.ClusterAuthorizationFailed):
		why = "not authorized: an ACL is missing (see the ACLs hipq needs in docs/operations.md)"
	default:
		return err.Error()
	}
	return why + ": " + err.Error()
}

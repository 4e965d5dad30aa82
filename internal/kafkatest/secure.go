package kafkatest

import (
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"net"
	"sync/atomic"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// Secure is what a cluster demands of its clients.
type Secure struct {
	// ServerTLS serves TLS (with ClientAuth set, mutual TLS); nil: plain
	// TCP.
	ServerTLS *tls.Config
	// ClientTLS is the TLS of the test's own clients: the CA to trust and,
	// under mutual TLS, a client certificate.
	ClientTLS *tls.Config
	// Mechanism makes every client authenticate with SASL: PLAIN,
	// SCRAM-SHA-256 or SCRAM-SHA-512; empty: no SASL.
	Mechanism string
	// Users may sign in with Mechanism.
	Users []User
	// ACLs turns authorization on: a user may do only what its ACLs grant
	// (the test's own clients sign in as a superuser). Needs Mechanism.
	ACLs bool
}

// User is a SASL user and, with Secure.ACLs, what it may do.
type User struct {
	Name, Password string
	ACLs           []kfake.ACL
}

// SuperUser is the name the test's own clients sign in with on a cluster
// with SASL.
const SuperUser = "hipq-test-admin"

// NewSecure starts a kfake cluster that demands s of every client, closed
// when t ends. It is always kfake, whatever HIPQ_TEST_KAFKA_BROKERS says: a
// test of security needs a broker that refuses what s does not allow.
func NewSecure(t testing.TB, s Secure) *Cluster {
	t.Helper()
	c := &Cluster{t: t, accepted: new(atomic.Int64)}
	opts := []kfake.Opt{kfake.NumBrokers(1), kfake.DefaultNumPartitions(1), kfake.ListenFn(func(network, addr string) (net.Listener, error) {
		l, err := net.Listen(network, addr)
		return counting{l, c.accepted}, err
	})}
	var client []kgo.Opt
	if s.ServerTLS != nil {
		opts = append(opts, kfake.TLS(s.ServerTLS))
		client = append(client, kgo.DialTLSConfig(s.ClientTLS))
	}
	if s.Mechanism != "" {
		b := make([]byte, 16)
		_, _ = rand.Read(b)
		pass := hex.EncodeToString(b)
		opts = append(opts, kfake.EnableSASL(), kfake.Superuser(s.Mechanism, SuperUser, pass))
		for _, u := range s.Users {
			opts = append(opts, kfake.User(s.Mechanism, u.Name, u.Password, u.ACLs...))
		}
		client = append(client, kgo.SASL(Mechanism(s.Mechanism, SuperUser, pass)))
	} else if s.ACLs {
		t.Fatal("kafkatest: ACLs need a SASL mechanism to tell users apart")
	}
	if s.ACLs {
		opts = append(opts, kfake.EnableACLs())
	} else {
		opts = append(opts, kfake.AllowAutoTopicCreation())
	}
	fake, err := kfake.NewCluster(opts...)
	if err != nil {
		t.Fatalf("start kfake: %v", err)
	}
	t.Cleanup(fake.Close)
	c.fake, c.Brokers, c.opts = fake, fake.ListenAddrs(), client
	return c
}

// Accepted is how many connections a cluster of NewSecure has accepted,
// refused ones included; 0 for others.
func (c *Cluster) Accepted() int64 {
	if c.accepted == nil {
		return 0
	}
	return c.accepted.Load()
}

// counting counts the connections a listener accepts.
type counting struct {
	net.Listener
	n *atomic.Int64
}

func (l counting) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return conn, err
}

// Mechanism is the franz-go SASL mechanism of a name.
func Mechanism(name, user, pass string) sasl.Mechanism {
	switch name {
	case "PLAIN":
		return plain.Auth{User: user, Pass: pass}.AsMechanism()
	case "SCRAM-SHA-256":
		return scram.Auth{User: user, Pass: pass}.AsSha256Mechanism()
	case "SCRAM-SHA-512":
		return scram.Auth{User: user, Pass: pass}.AsSha512Mechanism()
	}
	panic("kafkatest: no SASL mechanism " + name)
}

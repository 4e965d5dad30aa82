// Package kafkaconn builds franz-go clients from hipq's Kafka settings:
// brokers, TLS, SASL and logging, the same for every component.
package kafkaconn

import (
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	"github.com/twmb/franz-go/plugin/kzap"
	"go.uber.org/zap"

	"github.com/hipq/hipq/internal/tlsconf"
)

// Config is how to reach the cluster.
type Config struct {
	Brokers  []string
	ClientID string
	TLS      bool
	// CAFile holds the certificates that sign the brokers'; empty: the
	// system's.
	CAFile string
	// ServerName is the name the brokers' certificates must carry when it
	// is not the host name dialled (brokers reached by IP, or through a
	// tunnel); empty: the host name dialled.
	ServerName string
	// CertFile and KeyFile are the client certificate of mutual TLS.
	CertFile string
	KeyFile  string
	// SASLMechanism is empty, PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.
	SASLMechanism string
	Username      string
	Password      string
	// MetadataMinAge bounds how stale metadata may be; tests set it low so
	// leader changes are seen at once. Zero keeps franz-go's default.
	MetadataMinAge time.Duration
	// Compression is the codec of every record the client writes: none
	// (also ""), gzip, snappy, lz4 or zstd. Kafka's own producer writes
	// none by default; so does hipq, so that any consumer can read it.
	Compression string
}

// Compressions are the codecs hipq can write.
var Compressions = []string{"none", "gzip", "snappy", "lz4", "zstd"}

// Codec is the franz-go codec of a compression name.
func Codec(name string) (kgo.CompressionCodec, error) {
	switch name {
	case "", "none":
		return kgo.NoCompression(), nil
	case "gzip":
		return kgo.GzipCompression(), nil
	case "snappy":
		return kgo.SnappyCompression(), nil
	case "lz4":
		return kgo.Lz4Compression(), nil
	case "zstd":
		return kgo.ZstdCompression(), nil
	}
	return kgo.CompressionCodec{}, fmt.Errorf("compression %q is not one of none, gzip, snappy, lz4, zstd", name)
}

// NewClient returns a client with the connection options plus opts.
func NewClient(cfg Config, log *zap.Logger, opts ...kgo.Opt) (*kgo.Client, error) {
	level := kgo.LogLevelWarn
	if log.Core().Enabled(zap.DebugLevel) {
		level = kgo.LogLevelInfo // group joins, assignments, connections
	}
	codec, err := Codec(cfg.Compression)
	if err != nil {
		return nil, err
	}
	base := []kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.WithHooks(&connections{sasl: cfg.SASLMechanism != "", last: map[string]error{}}),
		kgo.WithLogger(kzap.New(log.Named("kafka"), kzap.Level(level))),
		// franz-go would write snappy, which stock clients (kafkajs) cannot read.
		kgo.ProducerBatchCompression(codec),
	}
	if cfg.ClientID != "" {
		base = append(base, kgo.ClientID(cfg.ClientID))
	}
	if cfg.MetadataMinAge > 0 {
		base = append(base, kgo.MetadataMinAge(cfg.MetadataMinAge), kgo.MetadataMaxAge(max(cfg.MetadataMinAge, time.Second)))
	}
	if cfg.TLS {
		// The client certificate is read again when its files change, so
		// a rotation reaches the next connection without a restart.
		tc, err := tlsconf.Client(tlsconf.Files{CAFile: cfg.CAFile, CertFile: cfg.CertFile, KeyFile: cfg.KeyFile, ServerName: cfg.ServerName})
		if err != nil {
			return nil, fmt.Errorf("kafka.tls.%w", err)
		}
		base = append(base, kgo.DialTLSConfig(tc))
	}
	switch cfg.SASLMechanism {
	case "":
	case "PLAIN":
		base = append(base, kgo.SASL(plain.Auth{User: cfg.Username, Pass: cfg.Password}.AsMechanism()))
	case "SCRAM-SHA-256":
		base = append(base, kgo.SASL(scram.Auth{User: cfg.Username, Pass: cfg.Password}.AsSha256Mechanism()))
	case "SCRAM-SHA-512":
		base = append(base, kgo.SASL(scram.Auth{User: cfg.Username, Pass: cfg.Password}.AsSha512Mechanism()))
	default:
		return nil, fmt.Errorf("kafka.sasl.mechanism: %q is not supported", cfg.SASLMechanism)
	}
	cl, err := kgo.NewClient(append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("kafka client: %w", err)
	}
	return cl, nil
}

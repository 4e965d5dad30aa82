// Package deadletter copies dead letters to a Kafka dead-letter topic after
// they are committed to PostgreSQL, whichever path dead-lettered them: the
// intake and response consumers, the sweeper (early replies past their
// TTL) and the API (refused callbacks).
package deadletter

import (
	"context"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
)

// Copier sends copies to one topic. A nil Copier, or one without a topic or
// client, only logs.
type Copier struct {
	Client *kgo.Client
	Topic  string
	Log    *zap.Logger
}

// Copy logs each dead letter and sends a copy, after commit, to the topic
// with its reason in a hipq-error header (an empty value for an input
// without one: never a tombstone). The headers hipq_dead_letter does
// not keep (credentials) are not copied either. PostgreSQL keeps the
// canonical copy, so a failed send is only logged, and so is a copy the
// client has no room for (its buffer full of copies a topic does not take):
// Copy never waits, so a dead-letter topic that takes nothing never holds
// up the consumer that copies to it.
func (c *Copier) Copy(dls []store.DeadLetter) {
	if c == nil {
		return
	}
	log := c.Log
	if log == nil {
		log = zap.NewNop()
	}
	for _, d := range dls {
		log.Warn("input dead-lettered", append(tracing.LogFieldsOf(correlator.TraceContextOf(d.Source.Headers)),
			zap.String("source", d.Kind), zap.String("topic", d.Source.Topic),
			zap.Int32("partition", d.Source.Partition), zap.Int64("offset", d.Source.Offset),
			zap.String("reason", correlator.Clip(d.Reason, 1024)))...)
		if c.Topic == "" || c.Client == nil {
			continue
		}
		// A copy is never a tombstone: an input without a value (a
		// producer's tombstone, a batch too large to read) goes with an
		// empty one, so that no reader of the topic takes it for a
		// deletion.
		value := d.Source.Value
		if value == nil {
			value = []byte{}
		}
		r := &kgo.Record{Topic: c.Topic, Key: d.Source.Key, Value: value}
		for _, h := range d.Source.Headers {
			if !store.SensitiveHeader(h.Key) {
				r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
			}
		}
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: correlator.HeaderError, Value: []byte(d.Reason)})
		c.Client.TryProduce(context.Background(), r, func(_ *kgo.Record, err error) {
			if err != nil {
				log.Warn("cannot copy dead letter to its topic; PostgreSQL keeps it", zap.String("topic", c.Topic), zap.Error(err))
			}
		})
	}
}

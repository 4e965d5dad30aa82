package dispatcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

// KafkaSendTimeout is how long a produce may take before it is given up:
// the job types' default send bound, which the sweeper waits, plus
// dispatch.grace, before taking an unsent claim for dead.
const KafkaSendTimeout = correlator.DefaultSendTimeout

// KafkaProducerOpts are the producer settings the Kafka transport needs:
// idempotent writes (franz-go's default) acknowledged by all in-sync
// replicas, bounded by KafkaSendTimeout.
func KafkaProducerOpts() []kgo.Opt {
	return []kgo.Opt{
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.RecordDeliveryTimeout(KafkaSendTimeout),
		kgo.ProducerLinger(0),
	}
}

// KafkaRoute is where one job type's requests go.
type KafkaRoute struct {
	Topic      string
	Envelope   bool
	ReplyTopic string
}

// KafkaSender produces requests with a shared client.
type KafkaSender struct {
	cl     *kgo.Client
	routes map[string]KafkaRoute // by job type
	// SendTimeout is the client's record delivery timeout; a topic that
	// refuses for longer ends its attempts as dispatch errors. Defaults to
	// KafkaSendTimeout.
	SendTimeout time.Duration
}

// NewKafkaSender sends the requests of the routed job types with cl.
func NewKafkaSender(cl *kgo.Client, routes map[string]KafkaRoute) *KafkaSender {
	return &KafkaSender{cl: cl, routes: routes, SendTimeout: KafkaSendTimeout}
}

type envelope struct {
	JobID   int64           `json:"job_id"`
	JobType string          `json:"job_type"`
	JobKey  string          `json:"job_key"`
	Attempt int             `json:"attempt"`
	JobData json.RawMessage `json:"job_data"`
	ReplyTo string          `json:"reply_to,omitempty"`
}

// Record builds the request record of a claimed job (SPEC §5).
func (r KafkaRoute) Record(c *store.Claimed) *kgo.Record {
	value := []byte(c.JobData)
	if r.Envelope {
		value, _ = json.Marshal(envelope{JobID: c.ID, JobType: c.JobType, JobKey: c.JobKey, Attempt: c.Attempt,
			JobData: c.JobData, ReplyTo: r.ReplyTopic})
	}
	// Room for every header below at once: one allocation, not a regrowth.
	headers := make([]kgo.RecordHeader, 4, 7)
	headers[0] = kgo.RecordHeader{Key: correlator.HeaderJobType, Value: []byte(c.JobType)}
	headers[1] = kgo.RecordHeader{Key: correlator.HeaderJobKey, Value: []byte(c.JobKey)}
	headers[2] = kgo.RecordHeader{Key: correlator.HeaderAttempt, Value: []byte(strconv.Itoa(c.Attempt))}
	headers[3] = kgo.RecordHeader{Key: correlator.HeaderJobID, Value: []byte(strconv.FormatInt(c.ID, 10))}
	rec := &kgo.Record{Topic: r.Topic, Key: []byte(c.JobKey), Value: value, Headers: headers}
	if r.ReplyTopic != "" {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: correlator.HeaderReplyTo, Value: []byte(r.ReplyTopic)})
	}
	for _, k := range []string{correlator.HeaderTraceParent, correlator.HeaderTraceState} {
		if v := c.Trace[k]; v != "" {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
		}
	}
	return rec
}

// Send produces every request and waits for the acknowledgements.
func (s *KafkaSender) Send(ctx context.Context, jobs []store.Claimed) []Result {
	recs := make([]*kgo.Record, len(jobs))
	for i := range jobs {
		recs[i] = s.routes[jobs[i].JobType].Record(&jobs[i])
	}
	results := s.cl.ProduceSync(ctx, recs...)
	out := make([]Result, len(jobs))
	for i, pr := range results {
		out[i] = classifyProduce(recs[i].Topic, pr.Err)
	}
	return out
}

// Route says where a job type's requests go: its topic, backed off apart
// from every other topic.
func (s *KafkaSender) Route(jobType string) Route {
	return Route{Neighbour: "kafka topic " + s.routes[jobType].Topic, Destination: s.routes[jobType].Topic, Timeout: s.SendTimeout}
}

// classifyProduce tells a refused produce (never written: undo the claim
// and back the topic off), a record at fault (a final dispatch error of the
// job: the same record would be refused again), and a produce whose fate is
// unknown. With idempotent writes franz-go fails a record only when that is
// safe, when it was never written (never sent, or answered with an error),
// so an error the broker answered, or a record timeout, means not sent. A
// record still in flight when the context ends or the client is closed
// (shutdown) may have been written.
func classifyProduce(topic string, err error) Result {
	switch {
	case err == nil:
		return Result{Status: Sent}
	case errors.Is(err, kerr.MessageTooLarge), errors.Is(err, kerr.RecordListTooLarge),
		errors.Is(err, kerr.InvalidRecord), errors.Is(err, kerr.CorruptMessage):
		return Result{Status: Failed, Final: true, Unwritten: true, Err: fmt.Errorf("the request cannot be written to topic %s: %w", topic, err)}
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded), errors.Is(err, kgo.ErrClientClosed):
		return Result{Status: Unknown, Err: fmt.Errorf("produce to %s: %w", topic, err)}
	}
	return Result{Status: Refused, Err: fmt.Errorf("produce to %s: %w", topic, err)}
}

// Transport names it in metrics.
func (s *KafkaSender) Transport() string { return "kafka" }

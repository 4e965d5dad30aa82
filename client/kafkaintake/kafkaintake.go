// Package kafkaintake produces hipq job requests to its intake topic with
// franz-go, the job_key as the record key (so requests for one key stay
// in order on one partition).
//
// A broker's acknowledgement is not yet acceptance by hipq: it means the
// record is durably in Kafka. hipq reads it later and makes it a job, or,
// should it refuse it (an unknown job type, a bad field), a dead letter
// in hipq_dead_letter and the intake dead-letter topic. To learn a job's
// fate, read it through the API (client.Get, client.Wait), or over Kafka:
// a Caller (NewCaller) produces a job naming a reply topic of its own and
// returns the job's outcome event from there (request/reply over Kafka,
// durable on hipq's side; hipq's events.allowed_reply_to must allow the
// topic). For a job that must exist exactly when a database transaction
// commits, use the outbox (pgxoutbox, sqloutbox) instead.
//
//	caller, err := kafkaintake.NewCaller(ctx, kafkaintake.New(cl, "hipq.jobs"), "billing.replies",
//		kgo.SeedBrokers("localhost:9092"))
//	...
//	defer caller.Close()
//	out, err := caller.Call(ctx, client.Job{Type: "invoice.quote", Key: "q-1", Data: data})
//	if err == nil && out.Succeeded() {
//		use(out.Result)
//	}
package kafkaintake

import (
	"context"
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/client"
)

// Producer writes job requests to one intake topic.
type Producer struct {
	cl    *kgo.Client
	topic string
}

// New returns a producer writing to topic (one of hipq's intake.topics)
// through cl, which the caller configures (brokers, TLS, SASL) and closes.
func New(cl *kgo.Client, topic string) *Producer { return &Producer{cl: cl, topic: topic} }

// Enqueue produces job and returns once the brokers acknowledged it (see
// the package doc: not yet acceptance by hipq). headers travel with it.
func (p *Producer) Enqueue(ctx context.Context, job client.Job, headers map[string]string) error {
	if job.Type == "" || job.Key == "" {
		return fmt.Errorf("hipq: a job needs a Type and a Key")
	}
	value, err := job.IntakeJSON()
	if err != nil {
		return fmt.Errorf("hipq: job %s/%s: %w", job.Type, job.Key, err)
	}
	r := &kgo.Record{Topic: p.topic, Key: []byte(job.Key), Value: value}
	for k, v := range headers {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
	}
	if err := p.cl.ProduceSync(ctx, r).FirstErr(); err != nil {
		return fmt.Errorf("hipq: produce %s/%s to %s: %w", job.Type, job.Key, p.topic, err)
	}
	return nil
}

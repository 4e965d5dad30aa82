package kafkaintake

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/client"
)

// Headers of the request/reply round trip over Kafka.
const (
	// HeaderReplyTo names, on an intake record, the topic the job's final
	// outcome event goes to. hipq's events.allowed_reply_to must allow it.
	HeaderReplyTo = "hipq-reply-to"
	// HeaderCorrelationID is copied by hipq from the intake record onto
	// the job's events, as every hipq-correlation-* header is.
	HeaderCorrelationID = "hipq-correlation-id"
	headerEventID       = "hipq-event-id"
)

// Outcome is how a job ended, as its outcome event says (hipq's
// docs/messages.md, "Outcome events").
type Outcome struct {
	JobType    string          `json:"job_type"`
	JobKey     string          `json:"job_key"`
	JobID      int64           `json:"job_id"`
	Attempt    int             `json:"attempt"`
	State      string          `json:"state"`   // final
	Outcome    string          `json:"outcome"` // succeeded, failed, timed_out, expired, cancelled
	Result     json.RawMessage `json:"result"`  // the reply's result when it succeeded, else null
	Error      *string         `json:"error"`   // why it failed; nil after a success
	CreatedAt  time.Time       `json:"created_at"`
	FinishedAt time.Time       `json:"finished_at"`
	// EventID is the event's hipq-event-id: the same when hipq sends it
	// again.
	EventID string `json:"-"`
}

// Succeeded reports whether the job succeeded.
func (o Outcome) Succeeded() bool { return o.Outcome == "succeeded" }

// Caller is request/reply over Kafka: Call produces a job to hipq's
// intake topic naming a reply topic of the caller's, and returns the job's
// outcome from that topic. Each call is matched to its outcome by a
// hipq-correlation-id of its own (hipq copies it onto the job's events)
// with the job's type and key: the intake's acknowledgement cannot carry
// the job's id, which hipq gives it later.
//
// The outcome is durable on hipq's side: hipq writes it in the
// transaction that ends the job and relays it after commit, so a restart
// of hipq while a call waits only delays the answer. The caller's side is
// not: the reply topic is read from where it ended when NewCaller
// returned, so calls of a caller that stopped get no answer from a new
// one (use the job's id, or hipq's API, to look them up).
//
// A call gets no answer (it waits until its ctx ends) when hipq makes no
// job of its record: a key whose job is still running (a duplicate: the
// running job answers its own caller), a record hipq dead-letters (an
// unknown type, a reply topic events.allowed_reply_to does not allow).
// Give every call a deadline.
type Caller struct {
	p       *Producer
	replyTo string
	cl      *kgo.Client

	mu      sync.Mutex
	waiting map[string]chan Outcome // by correlation id

	stop context.CancelFunc
	done chan struct{}
}

// NewCaller returns a caller producing with p and reading its outcomes from
// replyTo, a topic of the caller's own (one it alone reads: every outcome
// there is read by it) that hipq's events.allowed_reply_to allows. opts
// reach the brokers (kgo.SeedBrokers, TLS, SASL); the caller consumes
// replyTo with them, from its end now. Close it when done.
func NewCaller(ctx context.Context, p *Producer, replyTo string, opts ...kgo.Opt) (*Caller, error) {
	admin, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("hipq: caller: %w", err)
	}
	ends, err := kadm.NewClient(admin).ListEndOffsets(ctx, replyTo)
	admin.Close()
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("hipq: caller: the end of %s: %w", replyTo, err)
	}
	from := map[string]map[int32]kgo.Offset{replyTo: {}}
	ends.Each(func(o kadm.ListedOffset) { from[replyTo][o.Partition] = kgo.NewOffset().At(o.Offset) })
	if len(from[replyTo]) == 0 {
		return nil, fmt.Errorf("hipq: caller: topic %s has no partitions", replyTo)
	}
	cl, err := kgo.NewClient(append(append([]kgo.Opt(nil), opts...), kgo.ConsumePartitions(from))...)
	if err != nil {
		return nil, fmt.Errorf("hipq: caller: %w", err)
	}
	runCtx, stop := context.WithCancel(context.Background())
	c := &Caller{p: p, replyTo: replyTo, cl: cl, waiting: map[string]chan Outcome{}, stop: stop, done: make(chan struct{})}
	go c.read(runCtx)
	return c, nil
}

// Close stops reading outcomes; calls still waiting return an error.
func (c *Caller) Close() {
	c.stop()
	<-c.done
	c.cl.Close()
}

// ErrClosed is returned by a call of a closed caller.
var ErrClosed = errors.New("hipq: the caller is closed")

// Call produces job with the caller's reply topic and a correlation id of
// its own, and returns the job's outcome once it ended (whatever the
// outcome: a failed job is an Outcome, not an error). It returns ctx's
// error when ctx ends first; the job goes on in hipq.
func (c *Caller) Call(ctx context.Context, job client.Job) (Outcome, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return Outcome{}, fmt.Errorf("hipq: correlation id: %w", err)
	}
	id := hex.EncodeToString(b[:])
	ch := make(chan Outcome, 1)
	c.mu.Lock()
	if c.waiting == nil {
		c.mu.Unlock()
		return Outcome{}, ErrClosed
	}
	c.waiting[id] = ch
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		if c.waiting != nil {
			delete(c.waiting, id)
		}
		c.mu.Unlock()
	}()
	if err := c.p.Enqueue(ctx, job, map[string]string{HeaderReplyTo: c.replyTo, HeaderCorrelationID: id}); err != nil {
		return Outcome{}, err
	}
	select {
	case o, ok := <-ch:
		if !ok {
			return Outcome{}, ErrClosed
		}
		if o.JobType != job.Type || o.JobKey != job.Key {
			return o, fmt.Errorf("hipq: the outcome of correlation id %s is of %s/%s, not %s/%s", id, o.JobType, o.JobKey, job.Type, job.Key)
		}
		return o, nil
	case <-ctx.Done():
		return Outcome{}, ctx.Err()
	}
}

// read hands each outcome read to the call waiting for its correlation
// id; the others (a call that gave up, another caller's) are passed over.
func (c *Caller) read(ctx context.Context) {
	defer func() {
		c.mu.Lock()
		for _, ch := range c.waiting {
			close(ch)
		}
		c.waiting = nil
		c.mu.Unlock()
		close(c.done)
	}()
	for ctx.Err() == nil {
		fs := c.cl.PollFetches(ctx)
		fs.EachRecord(func(r *kgo.Record) {
			var id, eventID string
			for _, h := range r.Headers {
				switch h.Key {
				case HeaderCorrelationID:
					id = string(h.Value)
				case headerEventID:
					eventID = string(h.Value)
				}
			}
			if id == "" {
				return
			}
			var o Outcome
			if err := json.Unmarshal(r.Value, &o); err != nil || o.State != "final" {
				return
			}
			o.EventID = eventID
			c.mu.Lock()
			ch := c.waiting[id]
			delete(c.waiting, id) // (an event sent again finds nobody)
			c.mu.Unlock()
			if ch != nil {
				ch <- o
			}
		})
	}
}

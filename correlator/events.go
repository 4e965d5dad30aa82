package correlator

import (
	"fmt"
	"path"
	"strings"
)

// Outcome events: a record on Kafka for each end of a job (and, when asked,
// each attempt's end), written in the transaction that ends it and relayed
// after commit.

// Headers of outcome events (and of the intake records that ask for them).
const (
	// HeaderOutcome is an event's outcome: a final outcome, or
	// EventOutcomeRetry for an attempt that ended in a retry.
	HeaderOutcome = "hipq-outcome"
	// HeaderEventID is an event's id: the same event sent again carries
	// the same id, so consumers may drop repeats.
	HeaderEventID = "hipq-event-id"
	// HeaderCorrelationPrefix starts the names of the headers of an intake
	// record that hipq copies onto the job's events.
	HeaderCorrelationPrefix = "hipq-correlation-"
	// HeaderCorrelationID is the correlation header the Go client sets.
	HeaderCorrelationID = "hipq-correlation-id"
)

// EventOutcomeRetry is the outcome of an attempt event whose attempt ended
// in a retry.
const EventOutcomeRetry = "retry"

// CodeReplyToNotAllowed: an input names a reply_to topic that
// events.allowed_reply_to does not allow.
const CodeReplyToNotAllowed = "reply_to_not_allowed"

// Event occasions (events.on).
const (
	EventsOnFinal   = "final"
	EventsOnAttempt = "attempt"
)

// Events says where a job type's outcome events go.
type Events struct {
	// Topic receives the type's events; empty: none (but a job's own
	// reply_to still gets its final event).
	Topic string
	// Attempts: an event for each attempt that ends in a retry too, not
	// only the job's end.
	Attempts bool
}

// MaxCorrelationHeaders bounds the hipq-correlation-* headers kept with a
// job (the rest are left out).
const MaxCorrelationHeaders = 16

// ValidTopic checks a Kafka topic name: 1 to 249 of letters, digits, '.',
// '_' and '-', and neither "." nor "..".
func ValidTopic(t string) error {
	if t == "" {
		return fmt.Errorf("a topic name must not be empty")
	}
	if len(t) > 249 {
		return fmt.Errorf("topic %q is longer than 249 characters", Clip(t, 64))
	}
	if t == "." || t == ".." {
		return fmt.Errorf("topic %q is not a valid name", t)
	}
	for i := 0; i < len(t); i++ {
		if !topicChar(t[i]) {
			return fmt.Errorf("topic %q may hold only letters, digits, '.', '_' and '-'", Clip(t, 64))
		}
	}
	return nil
}

func topicChar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-'
}

// ValidTopicGlob checks a pattern of events.allowed_reply_to: a topic name
// whose '*' match any run of characters, '?' any one, and [...] a class.
func ValidTopicGlob(g string) error {
	if g == "" {
		return fmt.Errorf("a pattern must not be empty")
	}
	if _, err := path.Match(g, ""); err != nil {
		return fmt.Errorf("%q is not a valid pattern: %v", g, err)
	}
	if strings.Contains(g, "/") {
		return fmt.Errorf("%q: a topic name holds no '/'", g)
	}
	return nil
}

// TopicAllowed reports whether topic matches one of the globs.
func TopicAllowed(globs []string, topic string) bool {
	for _, g := range globs {
		if ok, _ := path.Match(g, topic); ok {
			return true
		}
	}
	return false
}

// CheckReplyTo refuses a reply_to topic the job type may not write to:
// one that is not a topic name, or that no pattern of
// events.allowed_reply_to (jt.AllowedReplyTo) matches. Empty: none asked.
func (jt *JobType) CheckReplyTo(topic string) error {
	if topic == "" {
		return nil
	}
	if err := ValidTopic(topic); err != nil {
		return &InputError{Code: CodeReplyToNotAllowed, Field: "reply_to", Detail: Clip(err.Error(), MaxDetailBytes)}
	}
	if jt == nil || !TopicAllowed(jt.AllowedReplyTo, topic) {
		return inputErrorf(CodeReplyToNotAllowed, "reply_to %q matches no pattern of events.allowed_reply_to", topic)
	}
	return nil
}

// TakeHeaders keeps with the job what its input's headers say of it: the
// trace context, the reply_to topic (header hipq-reply-to, which its type
// must allow, else an *InputError of code reply_to_not_allowed) and the
// hipq-correlation-* headers, which its events carry back.
func (j *Job) TakeHeaders(hs []Header, jt *JobType) error {
	j.Trace = TraceContextOf(hs)
	j.Correlation = nil
	for _, h := range hs {
		switch {
		case strings.EqualFold(h.Key, HeaderReplyTo):
			j.ReplyTo = string(h.Value)
		case len(h.Key) > len(HeaderCorrelationPrefix) && strings.EqualFold(h.Key[:len(HeaderCorrelationPrefix)], HeaderCorrelationPrefix):
			if len(j.Correlation) < MaxCorrelationHeaders {
				j.Correlation = append(j.Correlation, Header{Key: h.Key, Value: append([]byte(nil), h.Value...)})
			}
		}
	}
	return jt.CheckReplyTo(j.ReplyTo)
}

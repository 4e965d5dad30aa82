package correlator

import (
	"errors"
	"strings"
	"testing"
)

func TestCheckReplyTo(t *testing.T) {
	jt := &JobType{AllowedReplyTo: []string{"callers.*", "billing.replies", "svc-?"}}
	for _, c := range []struct {
		topic string
		ok    bool
	}{
		{"", true}, // none asked
		{"callers.a", true},
		{"callers.", true},
		{"billing.replies", true},
		{"svc-1", true},
		{"svc-12", false},
		{"billing.replies2", false},
		{"payments", false},
		{"callers/a", false},              // no topic name
		{"callers.a b", false},            // no topic name
		{strings.Repeat("a", 250), false}, // too long
		{"..", false},
	} {
		err := jt.CheckReplyTo(c.topic)
		var ie *InputError
		if c.ok != (err == nil) || (err != nil && (!errors.As(err, &ie) || ie.Code != CodeReplyToNotAllowed)) {
			t.Errorf("CheckReplyTo(%q) = %v, want ok %v (else %s)", c.topic, err, c.ok, CodeReplyToNotAllowed)
		}
	}
	if err := (&JobType{}).CheckReplyTo("callers.a"); err == nil {
		t.Error("a type allowing none took a reply_to")
	}
}

func TestTakeHeaders(t *testing.T) {
	jt := &JobType{AllowedReplyTo: []string{"callers.*"}}
	j := &Job{}
	hs := []Header{
		{Key: "traceparent", Value: []byte("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")},
		{Key: "Hipq-Reply-To", Value: []byte("callers.x")},
		{Key: "hipq-correlation-id", Value: []byte("c-1")},
		{Key: "hipq-correlation-tenant", Value: []byte("t-9")},
		{Key: "hipq-correlation-", Value: []byte("no name")},
		{Key: "other", Value: []byte("left")},
	}
	if err := j.TakeHeaders(hs, jt); err != nil {
		t.Fatal(err)
	}
	if j.ReplyTo != "callers.x" || j.Trace.Parent == "" || len(j.Correlation) != 2 ||
		j.Correlation[0].Key != "hipq-correlation-id" || string(j.Correlation[1].Value) != "t-9" {
		t.Errorf("took %+v", j)
	}
	if err := (&Job{}).TakeHeaders([]Header{{Key: HeaderReplyTo, Value: []byte("elsewhere")}}, jt); err == nil ||
		!strings.HasPrefix(err.Error(), CodeReplyToNotAllowed+": ") {
		t.Errorf("a reply_to not allowed: %v", err)
	}
	many := make([]Header, 40)
	for i := range many {
		many[i] = Header{Key: HeaderCorrelationPrefix + strings.Repeat("x", i+1)}
	}
	k := &Job{}
	if err := k.TakeHeaders(many, jt); err != nil || len(k.Correlation) != MaxCorrelationHeaders {
		t.Errorf("kept %d correlation headers (%v), want at most %d", len(k.Correlation), err, MaxCorrelationHeaders)
	}
}

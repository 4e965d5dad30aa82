package correlator

import (
	"net/url"
	"strings"
	"testing"
)

func TestCallbackURL(t *testing.T) {
	secret := []byte(strings.Repeat("s", 32))
	u := CallbackURL("https://hipq.example/", secret, 42, "invoice.ship", "a/b c", 3)
	p, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	if p.EscapedPath() != "/v1/jobs/invoice.ship/a%2Fb%20c/response" {
		t.Fatalf("path %s", p.EscapedPath())
	}
	q := p.Query()
	if q.Get("job_id") != "42" || q.Get("attempt") != "3" {
		t.Fatalf("query %v", q)
	}
	sig := q.Get("sig")
	if strings.ContainsAny(sig, "=+/") || len(sig) != 43 {
		t.Fatalf("sig %q is not unpadded base64url of 32 bytes", sig)
	}
	if !CallbackSignatureValid(secret, 42, "invoice.ship", "a/b c", 3, sig) {
		t.Fatal("own signature refused")
	}
	for name, ok := range map[string]bool{
		"other attempt": CallbackSignatureValid(secret, 42, "invoice.ship", "a/b c", 2, sig),
		"other id":      CallbackSignatureValid(secret, 43, "invoice.ship", "a/b c", 3, sig),
		"other key":     CallbackSignatureValid(secret, 42, "invoice.ship", "a/b d", 3, sig),
		"other secret":  CallbackSignatureValid([]byte(strings.Repeat("t", 32)), 42, "invoice.ship", "a/b c", 3, sig),
		"tampered":      CallbackSignatureValid(secret, 42, "invoice.ship", "a/b c", 3, tamper(sig)),
		"empty":         CallbackSignatureValid(secret, 42, "invoice.ship", "a/b c", 3, ""),
	} {
		if ok {
			t.Errorf("%s: accepted", name)
		}
	}
}

// tamper changes the first character of s.
func tamper(s string) string {
	if s[0] == 'A' {
		return "B" + s[1:]
	}
	return "A" + s[1:]
}

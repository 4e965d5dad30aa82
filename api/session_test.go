package api

import (
	"crypto/sha256"
	"encoding/base64"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
)

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// browser is a cookie jar and a client that follows no redirects.
type browser struct {
	t   *testing.T
	c   *http.Client
	url string
}

func newBrowser(t *testing.T, base string, tr http.RoundTripper) *browser {
	jar, _ := cookiejar.New(nil)
	return &browser{t: t, url: base, c: &http.Client{Jar: jar, Transport: tr,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

// get returns the status, the redirect's target and the body.
func (b *browser) get(path string) (int, string, string) {
	b.t.Helper()
	resp, err := b.c.Get(b.url + path)
	if err != nil {
		b.t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("Location"), string(body)
}

func (b *browser) post(path string, form url.Values, header ...string) *http.Response {
	b.t.Helper()
	req, _ := http.NewRequest(http.MethodPost, b.url+path, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := b.c.Do(req)
	if err != nil {
		b.t.Fatal(err)
	}
	resp.Body.Close()
	return resp
}

// signIn signs in with token and returns the session cookie's value.
func (b *browser) signIn(token string, header ...string) (*http.Response, string) {
	b.t.Helper()
	_, _, body := b.get("/ui/login")
	resp := b.post("/ui/login", url.Values{"token": {token}, "csrf": {csrfField.FindStringSubmatch(body)[1]}}, header...)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/" {
		b.t.Fatalf("sign-in: %d to %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	return resp, b.session()
}

func (b *browser) session() string {
	u, _ := url.Parse(b.url + "/ui/")
	for _, c := range b.c.Jar.Cookies(u) {
		if c.Name == uiSessionCookie {
			return c.Value
		}
	}
	return ""
}

// signedIn: the overview answers 200, not a redirect to the login page.
func (b *browser) signedIn() bool {
	b.t.Helper()
	code, loc, _ := b.get("/ui/")
	if code != http.StatusOK && !strings.Contains(loc, "/ui/login") {
		b.t.Fatalf("the overview: %d to %q", code, loc)
	}
	return code == http.StatusOK
}

// A dashboard session is a random id whose hash PostgreSQL keeps with an
// expiry that slides while it is used: the cookie holds neither the token
// nor anything made from it, sign-out ends the session on the server (the
// cookie, replayed, signs in no one), an expired session is refused and
// pruned at the next sign-in, and removing the token from the config (or
// moving it to another role) ends its sessions. The cookies are Secure
// over TLS, behind a TLS proxy, and when public_url is https.
func TestDashboardSessions(t *testing.T) {
	t.Parallel()
	read := strings.Repeat("r", 32)
	ttl := 12 * time.Hour // api.ui.session_ttl's default
	e := newAPIConfig(t, func(c *Config) { c.ReadTokens = []string{read}; c.UI = &UIConfig{} }, token)
	expiresIn := func(id string) time.Duration {
		t.Helper()
		raw, err := base64.RawURLEncoding.DecodeString(id)
		if err != nil {
			t.Fatalf("the session cookie %q is not base64url: %v", id, err)
		}
		h := sha256.Sum256(raw)
		var left float64
		if err := e.st.Pool().QueryRow(ctx, `SELECT coalesce((SELECT extract(epoch FROM expires_at - now()) FROM hipq_ui_session WHERE id_hash = $1), -1)`,
			h[:]).Scan(&left); err != nil {
			t.Fatal(err)
		}
		return time.Duration(left * float64(time.Second))
	}
	setExpiry := func(id, in string) {
		t.Helper()
		raw, _ := base64.RawURLEncoding.DecodeString(id)
		h := sha256.Sum256(raw)
		if _, err := e.st.Pool().Exec(ctx, `UPDATE hipq_ui_session SET expires_at = now() + $2::interval WHERE id_hash = $1`, h[:], in); err != nil {
			t.Fatal(err)
		}
	}

	b := newBrowser(t, e.url, nil)
	if b.signedIn() {
		t.Fatal("signed in before signing in")
	}
	_, id := b.signIn(token)
	if !b.signedIn() {
		t.Fatal("not signed in after signing in")
	}
	if strings.Contains(id, token) || id == base64.RawURLEncoding.EncodeToString([]byte(token)) {
		t.Fatalf("the session cookie %q is made from the token", id)
	}
	var rows int
	if err := e.st.Pool().QueryRow(ctx, `SELECT count(*) FROM hipq_ui_session WHERE position($1::bytea IN token_hash) > 0 OR position($1::bytea IN id_hash) > 0`,
		[]byte(token)).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("a session row holds the token (%d, %v)", rows, err)
	}
	if left := expiresIn(id); left < ttl-time.Minute || left > ttl {
		t.Fatalf("a new session expires in %v, want %v", left, ttl)
	}

	// Sliding: a session used after a while is extended to the full ttl.
	setExpiry(id, "3 hours")
	if !b.signedIn() {
		t.Fatal("a session with 3 hours left was refused")
	}
	if left := expiresIn(id); left < ttl-time.Minute {
		t.Fatalf("a session in use expires in %v, want it moved to %v", left, ttl)
	}

	// Expired: refused, and deleted at the next sign-in (anyone's).
	setExpiry(id, "-1 second")
	if b.signedIn() {
		t.Fatal("an expired session was taken")
	}
	other := newBrowser(t, e.url, nil)
	_, readID := other.signIn(read)
	if left := expiresIn(id); left != -time.Second {
		t.Fatalf("the expired session was not pruned at a sign-in (left %v)", left)
	}

	// Sign-out ends the session on the server: the cookie, replayed by
	// another browser, signs in no one.
	_, id = b.signIn(token)
	_, _, body := b.get("/ui/")
	if resp := b.post("/ui/logout", url.Values{"csrf": {csrfField.FindStringSubmatch(body)[1]}}); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("sign-out: %d", resp.StatusCode)
	}
	if b.signedIn() {
		t.Fatal("signed in after signing out")
	}
	thief := newBrowser(t, e.url, nil)
	u, _ := url.Parse(e.url + "/ui/")
	thief.c.Jar.SetCookies(u, []*http.Cookie{{Name: uiSessionCookie, Value: id, Path: "/ui/"}})
	if thief.signedIn() {
		t.Fatal("a signed-out session's cookie still signs in")
	}
	if left := expiresIn(id); left != -time.Second {
		t.Fatalf("the signed-out session is still stored (left %v)", left)
	}

	// The token removed from the config (here: a server of the same
	// deployment with other tokens), or given another role: its sessions
	// end, and stay ended when it comes back.
	b.signIn(token)
	serve := func(tokens, reads []string) string {
		s := New(zaptest.NewLogger(t), e.st, Config{Tokens: tokens, ReadTokens: reads, CallbackSecret: secret, Queues: []string{"default"},
			UI: &UIConfig{}})
		srv := httptest.NewServer(s.Handler())
		t.Cleanup(srv.Close)
		return srv.URL
	}
	b.url = serve([]string{strings.Repeat("n", 32)}, []string{read})
	if b.signedIn() {
		t.Fatal("a session of a token no longer configured was taken")
	}
	b.url = e.url
	if b.signedIn() {
		t.Fatal("a session revoked for its token's removal came back with the token")
	}
	other.url = serve([]string{token}, []string{strings.Repeat("n", 32)})
	if other.signedIn() {
		t.Fatal("a read session was taken after its token left api.read_tokens")
	}
	if left := expiresIn(readID); left != -time.Second {
		t.Fatalf("the read session of a token no longer read is still stored (left %v)", left)
	}
	b.signIn(token)
	b.url = serve([]string{strings.Repeat("n", 32)}, []string{token})
	if b.signedIn() {
		t.Fatal("an admin session was taken with its token moved to api.read_tokens")
	}

	// Secure cookies.
	secure := func(resp *http.Response) bool {
		t.Helper()
		for _, c := range resp.Cookies() {
			if c.Name == uiSessionCookie {
				return c.Secure
			}
		}
		t.Fatal("no session cookie set")
		return false
	}
	if resp, _ := newBrowser(t, e.url, nil).signIn(token); secure(resp) {
		t.Error("a session cookie over plain http without a TLS proxy or public_url is Secure")
	}
	if resp, _ := newBrowser(t, e.url, nil).signIn(token, "X-Forwarded-Proto", "https"); !secure(resp) {
		t.Error("a session cookie behind a TLS proxy is not Secure")
	}
	tls := httptest.NewUnstartedServer(New(zaptest.NewLogger(t), e.st, Config{Tokens: []string{token}, CallbackSecret: secret,
		UI: &UIConfig{}}).Handler())
	tls.StartTLS()
	t.Cleanup(tls.Close)
	if resp, _ := newBrowser(t, tls.URL, tls.Client().Transport).signIn(token); !secure(resp) {
		t.Error("a session cookie over TLS is not Secure")
	}
	public := httptest.NewServer(New(zaptest.NewLogger(t), e.st, Config{Tokens: []string{token}, CallbackSecret: secret,
		UI: &UIConfig{SecureCookies: true}}).Handler())
	t.Cleanup(public.Close)
	if resp, _ := newBrowser(t, public.URL, nil).signIn(token); !secure(resp) {
		t.Error("a session cookie with an https public_url is not Secure")
	}
}

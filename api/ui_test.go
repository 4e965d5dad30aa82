package api

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"testing"
)

// The read role may GET anything and change nothing, in the API as in
// the dashboard; callbacks need an admin token (or their signature).
func TestReadRole(t *testing.T) {
	t.Parallel()
	read := strings.Repeat("r", 32)
	e := newAPIConfig(t, func(c *Config) { c.ReadTokens = []string{read} }, token)
	e.want("PUT", "/v1/jobs/t/k1", `{}`, 201)
	e.token = read
	e.want("GET", "/v1/jobs/t/k1", "", 200)
	e.want("GET", "/v1/jobs?key_prefix=k", "", 200)
	e.want("GET", "/v1/queues", "", 200)
	for _, p := range []string{"/v1/queues/default/pause", "/v1/jobs/t/k1/cancel", "/v1/dead-letters/1/replay", "/v1/schedules/x/trigger"} {
		if out := e.want("POST", p, "", 403); errCode(out) != "forbidden" {
			t.Errorf("%s: %v", p, out)
		}
	}
	e.want("PUT", "/v1/jobs/t/k2", `{}`, 403)
	e.want("POST", "/v1/jobs/t/k1/response", `{"status": "succeeded"}`, 401)
	e.token = token
	if j := job(e.want("GET", "/v1/jobs/t/k1", "", 200)); j["state"] != "initial" {
		t.Fatalf("a read token changed the job: %v", j)
	}
}

func TestQueuesListAndKeyPrefix(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	for _, k := range []string{"order-1", "order-2", "ord", "refund-1"} {
		e.want("PUT", "/v1/jobs/t/"+k, `{}`, 201)
	}
	l := e.want("GET", "/v1/jobs?key_prefix=order-", "", 200)["jobs"].([]any)
	if len(l) != 2 {
		t.Fatalf("key_prefix=order-: %v", l)
	}
	// LIKE's wildcards are plain characters in a prefix.
	if l := e.want("GET", "/v1/jobs?key_prefix=ord%25", "", 200)["jobs"].([]any); len(l) != 0 {
		t.Fatalf("key_prefix=ord%%: %v", l)
	}
	e.want("POST", "/v1/queues/default/pause", "", 200)
	qs := e.want("GET", "/v1/queues", "", 200)["queues"].([]any)
	if len(qs) != 1 || qs[0].(map[string]any)["paused"] != true {
		t.Fatalf("GET /v1/queues: %v", qs)
	}
}

// The dashboard's guards, without a browser: every page sends the CSP,
// a page without a session goes to the login page, a POST without the
// CSRF token of its browser is refused, redirects stay inside.
func TestDashboardGuards(t *testing.T) {
	t.Parallel()
	e := newAPIConfig(t, func(c *Config) { c.UI = &UIConfig{PathPrefix: "/p", Redact: []string{"/card/number", "/list/1"}} }, token)
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}
	resp, err := c.Get(e.url + "/p/ui/jobs")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.HasSuffix(resp.Request.URL.Path, "/p/ui/login") {
		t.Fatalf("without a session: at %s", resp.Request.URL)
	}
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.HasPrefix(csp, "default-src 'self'") {
		t.Errorf("CSP: %q", csp)
	}
	csrf := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindSubmatch(body)
	if csrf == nil {
		t.Fatalf("no CSRF token: %s", body)
	}
	post := func(path string, form url.Values) int {
		resp, err := c.PostForm(e.url+path, form)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := post("/p/ui/login", url.Values{"token": {token}}); got != 403 {
		t.Errorf("sign-in without the CSRF token: %d", got)
	}
	if got := post("/p/ui/login", url.Values{"token": {token}, "csrf": {string(csrf[1])}, "next": {"//evil.example/"}}); got != 200 {
		t.Errorf("sign-in: %d", got)
	}
	if got := post("/p/ui/act/pause", url.Values{"queue": {"default"}, "csrf": {"00" + string(csrf[1])[2:]}}); got != 403 {
		t.Errorf("a wrong CSRF token: %d", got)
	}
	if got := post("/p/ui/act/pause", url.Values{"queue": {"default"}, "csrf": {string(csrf[1])}, "back": {"/p/ui/queues"}}); got != 200 {
		t.Errorf("pause: %d", got)
	}
	if paused, _ := e.st.QueuesPaused(ctx); !paused["default"] {
		t.Error("the dashboard's pause did not pause")
	}

	u := &ui{cfg: UIConfig{Redact: []string{"/card/number", "/list/1", "/a~1b"}}}
	got := u.redact(json.RawMessage(`{"card": {"number": "4111", "cvc": 1}, "list": [1, 2], "a/b": 3, "n": 12345678901234567890}`))
	want := `{"a/b":"[redacted]","card":{"cvc":1,"number":"[redacted]"},"list":[1,"[redacted]"],"n":12345678901234567890}`
	if string(got) != want {
		t.Errorf("redact: %s, want %s", got, want)
	}
	if got := u.redact(json.RawMessage(`"plain"`)); string(got) != `"plain"` {
		t.Errorf("redact of a string: %s", got)
	}
}

// Links keep a key "0" (only empty strings and zero numbers are left out).
func TestDashboardLinks(t *testing.T) {
	u := &ui{base: "/ui"}
	if got := u.link("job", "job_type", "t", "job_key", "0", "id", int64(0)); got != "/ui/job?job_key=0&job_type=t" {
		t.Errorf("link: %s", got)
	}
	if got := u.link("jobs", "queue", "", "before", int64(42)); got != "/ui/jobs?before=42" {
		t.Errorf("link: %s", got)
	}
}

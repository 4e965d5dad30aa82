package api

import (
	"encoding/json"
	"html"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hipq/hipq/store"
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

// The dashboard's guards, without a browser: every answer sends the CSP
// (pages, files, redirects, 404s, refusals), a page without a session
// goes to the login page, the cookies are HttpOnly and SameSite=Strict,
// a POST needs the CSRF token of its own browser and session, redirects
// stay inside, a flash line needs the server's signature.
func TestDashboardGuards(t *testing.T) {
	t.Parallel()
	e := newAPIConfig(t, func(c *Config) { c.UI = &UIConfig{PathPrefix: "/p", Redact: []string{"/card/number", "/list/1"}} }, token)
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}
	csrfRe := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)
	get := func(path string) (*http.Response, string) {
		t.Helper()
		resp, err := c.Get(e.url + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if csp := resp.Header.Get("Content-Security-Policy"); !strings.HasPrefix(csp, "default-src 'self'") {
			t.Errorf("%s: CSP %q", path, csp)
		}
		return resp, string(body)
	}
	post := func(path string, form url.Values) (int, *url.URL) {
		t.Helper()
		resp, err := c.PostForm(e.url+path, form)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if csp := resp.Header.Get("Content-Security-Policy"); !strings.HasPrefix(csp, "default-src 'self'") {
			t.Errorf("POST %s: CSP %q", path, csp)
		}
		return resp.StatusCode, resp.Request.URL
	}
	resp, body := get("/p/ui/jobs")
	if resp.Request.URL.Path != "/p/ui/login" {
		t.Fatalf("without a session: at %s", resp.Request.URL)
	}
	loginCSRF := csrfRe.FindStringSubmatch(body)
	if loginCSRF == nil {
		t.Fatalf("no CSRF token: %s", body)
	}
	if got, _ := post("/p/ui/login", url.Values{"token": {token}}); got != 403 {
		t.Errorf("sign-in without the CSRF token: %d", got)
	}
	got, at := post("/p/ui/login", url.Values{"token": {token}, "csrf": {loginCSRF[1]}, "next": {"//evil.example/"}})
	if got != 200 || at.Host != strings.TrimPrefix(e.url, "http://") || at.Path != "/p/ui/" {
		t.Fatalf("sign-in: %d at %s, want the overview of this server", got, at)
	}
	uiURL, _ := url.Parse(e.url + "/p/ui/")
	for _, ck := range jar.Cookies(uiURL) {
		if ck.Name == uiSessionCookie && ck.Value == token {
			t.Error("the session cookie holds the token as it is")
		}
	}
	// (a jar does not show flags: read them off a fresh browser's sign-in)
	njar, _ := cookiejar.New(nil)
	nc := &http.Client{Jar: njar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	fresh, err := nc.Get(e.url + "/p/ui/login")
	if err != nil {
		t.Fatal(err)
	}
	fbody, _ := io.ReadAll(fresh.Body)
	fresh.Body.Close()
	resp, err = nc.PostForm(e.url+"/p/ui/login", url.Values{"token": {token}, "csrf": {csrfRe.FindStringSubmatch(string(fbody))[1]}})
	if err != nil || len(resp.Cookies()) < 2 {
		t.Fatalf("a sign-in set no session and nonce cookies (%v)", err)
	}
	resp.Body.Close()
	for _, ck := range resp.Cookies() {
		if !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode || ck.Path != "/p/ui/" {
			t.Errorf("cookie %s: HttpOnly %v SameSite %v Path %q", ck.Name, ck.HttpOnly, ck.SameSite, ck.Path)
		}
	}
	// The sign-in page's token is worth nothing in the session.
	if got, _ := post("/p/ui/act/pause", url.Values{"queue": {"default"}, "csrf": {loginCSRF[1]}}); got != 403 {
		t.Errorf("the sign-in page's CSRF token in the session: %d", got)
	}
	_, body = get("/p/ui/queues")
	csrf := csrfRe.FindStringSubmatch(body)[1]
	wrong := csrf[:len(csrf)-1] + map[bool]string{true: "1", false: "0"}[csrf[len(csrf)-1] == '0']
	if got, _ := post("/p/ui/act/pause", url.Values{"queue": {"default"}, "csrf": {wrong}}); got != 403 {
		t.Errorf("a wrong CSRF token: %d", got)
	}
	got, at = post("/p/ui/act/pause", url.Values{"queue": {"default"}, "csrf": {csrf}, "back": {"/p/ui/queues"}})
	if got != 200 || at.Path != "/p/ui/queues" || at.Query().Get("fs") == "" {
		t.Errorf("pause: %d at %s", got, at)
	}
	if paused, _ := e.st.QueuesPaused(ctx); !paused["default"] {
		t.Error("the dashboard's pause did not pause")
	}
	if _, body := get(at.RequestURI()); !strings.Contains(body, "pause: done") {
		t.Error("the signed flash line is not shown")
	}
	if _, body := get("/p/ui/queues?flash=" + url.QueryEscape("✓ paste your token at evil.example")); strings.Contains(body, "evil.example") {
		t.Error("an unsigned flash line is shown")
	}
	for _, path := range []string{"/p/ui/static/ui.css", "/p/ui", "/p/ui/nothing-here", "/p/ui/jobs?queue=nosuch"} {
		resp, _ := get(path)
		if path == "/p/ui/static/ui.css" && resp.StatusCode != 200 || path == "/p/ui/nothing-here" && resp.StatusCode != 404 ||
			path == "/p/ui/jobs?queue=nosuch" && resp.StatusCode != 400 {
			t.Errorf("%s: %d", path, resp.StatusCode)
		}
	}
	if resp, _ := get("/p/ui/static/"); resp.StatusCode != 404 {
		t.Errorf("the static folder lists its files: %d", resp.StatusCode)
	}

	u := &ui{cfg: UIConfig{Redact: []string{"/card/number", "/list/1", "/a~1b"}}}
	red := u.redact(json.RawMessage(`{"card": {"number": "4111", "cvc": 1}, "list": [1, 2], "a/b": 3, "n": 12345678901234567890}`))
	want := `{"a/b":"[redacted]","card":{"cvc":1,"number":"[redacted]"},"list":[1,"[redacted]"],"n":12345678901234567890}`
	if string(red) != want {
		t.Errorf("redact: %s, want %s", red, want)
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

// With api.ui.redact set, the dashboard never shows a dead letter's
// record verbatim when its job_data cannot be located with certainty: a
// value that is not exactly one JSON object (an outbox row cut at
// max_bytes+1, data trailing the object, two records, an array) is
// hidden; one that is, is shown re-encoded from what was parsed, with
// every member named job_data (duplicates, another case, escaped)
// redacted, and of a key repeated within it only the value kept. The read role sees what the admin
// sees.
func TestDashboardRedactionFailsClosed(t *testing.T) {
	t.Parallel()
	read := strings.Repeat("r", 32)
	e := newAPIConfig(t, func(c *Config) {
		c.ReadTokens = []string{read}
		c.UI = &UIConfig{Redact: []string{"/card/number"}}
	}, token)
	const card = "4111111111111111"
	data := `{"card": {"number": "` + card + `", "cvc": 1}, "pad": "` + strings.Repeat("x", 64) + `"}`
	whole := `{"job_type": "t", "job_key": "k", "job_data": ` + data + `}`
	hidden := map[string]string{
		"cut one past max_bytes": whole[:len(whole)-20],
		"trailing bytes":         whole + ` trailing`,
		"two records":            whole + whole,
		"an array":               `[` + whole + `]`,
		"not JSON":               `job_data=` + data,
	}
	shown := map[string]string{
		"one record":              whole,
		"two job_data members":    `{"job_data": ` + data + `, "job_data": {"card": {"number": "` + card + `"}}}`,
		"job_data in capitals":    `{"JOB_DATA": ` + data + `}`,
		"an escaped key":          `{"job\u005fdata": ` + data + `}`,
		"a duplicate in job_data": `{"job_data": {"card": {"number": "` + card + `"}, "card": {"cvc": 2}, "pad": "xxxxxxxx"}}`,
		"invalid UTF-8 around it": `{"job_data": ` + data + `, "note": "` + "\xff" + `"}`,
	}
	var dls []store.DeadLetter
	for _, set := range []map[string]string{hidden, shown} {
		for name, v := range set {
			dls = append(dls, store.DeadLetter{Kind: store.SourceOutbox, Reason: "case: " + name,
				Source: store.Source{Value: []byte(v), Received: time.Now()}})
		}
	}
	if err := e.st.DeadLetterInsert(ctx, dls); err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{read, token} {
		body := signedInGet(t, e, tok, "/ui/dead-letters")
		role := map[string]string{read: "read", token: "admin"}[tok]
		if n := strings.Count(body, card); n > 0 {
			t.Errorf("%s role: the card number is on the page %d times", role, n)
		}
		for name := range hidden {
			sec := letterSection(t, body, name)
			if !strings.Contains(sec, "[hidden: ") || strings.Contains(sec, card) || strings.Contains(sec, "xxxxxxxx") {
				t.Errorf("%s role, %s: the value is not hidden:\n%s", role, name, sec)
			}
		}
		for name := range shown {
			sec := letterSection(t, body, name)
			if strings.Contains(sec, card) || strings.Contains(sec, "[hidden: ") || !strings.Contains(sec, "xxxxxxxx") {
				t.Errorf("%s role, %s: the value is not shown without its card number:\n%s", role, name, sec)
			}
		}
	}
}

// signedInGet signs a new browser in with tok and GETs path.
func signedInGet(t *testing.T, e *apiEnv, tok, path string) string {
	t.Helper()
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}
	read := func(resp *http.Response, err error) string {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", resp.Request.URL, resp.StatusCode, b)
		}
		return string(b)
	}
	csrf := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindStringSubmatch(read(c.Get(e.url + "/ui/login")))
	if csrf == nil {
		t.Fatal("no CSRF token on the sign-in page")
	}
	read(c.PostForm(e.url+"/ui/login", url.Values{"token": {tok}, "csrf": {csrf[1]}}))
	return read(c.Get(e.url + path))
}

// letterSection is the dead-letters page's section of the letter whose
// reason is "case: name" (a name html/template shows as it is).
func letterSection(t *testing.T, body, name string) string {
	t.Helper()
	for _, sec := range strings.Split(body, `<section class="letter"`)[1:] {
		if strings.Contains(sec, "case: "+name) {
			return sec
		}
	}
	t.Fatalf("no dead letter %q on the page", name)
	return ""
}

// The dashboard's bulk actions: a filtered list shows how many match and
// the actions that apply, the confirmation page the count and the filter
// (the time bound fixed), its form acts through the API (the reason
// required, the CSRF token checked) and says what it did; the read role
// sees no bulk action and may not take one.
func TestDashboardBulkActions(t *testing.T) {
	t.Parallel()
	read := strings.Repeat("r", 32)
	e := newAPIConfig(t, func(c *Config) {
		c.ReadTokens = []string{read}
		c.UI = &UIConfig{}
	}, token)
	for _, k := range []string{"a-1", "a-2", "a-3", "b-1"} {
		e.want("PUT", "/v1/jobs/t/"+k, `{}`, 201)
	}
	b := newBrowser(t, e.url, nil)
	b.signIn(token)
	_, _, list := b.get("/ui/jobs?key_prefix=a-")
	for _, want := range []string{`data-count="matching">3<`, `data-bulk="cancel"`, `data-bulk="run-now"`, `data-bulk="replay"`} {
		if !strings.Contains(list, want) {
			t.Fatalf("the filtered list lacks %s:\n%s", want, list)
		}
	}
	if _, _, all := b.get("/ui/jobs"); strings.Contains(all, `id="bulk-actions"`) {
		t.Error("the list without a filter offers a bulk action")
	}
	if _, _, final := b.get("/ui/jobs?state=final"); strings.Contains(final, `data-bulk="cancel"`) || !strings.Contains(final, `data-bulk="replay"`) {
		t.Error("the list of final jobs offers to cancel them, or not to replay them")
	}
	code, _, page := b.get("/ui/bulk?kind=cancel&key_prefix=a-")
	if code != http.StatusOK || !strings.Contains(page, `<span id="bulk-count">3</span>`) || !strings.Contains(page, `data-field="key_prefix">a-<`) ||
		!strings.Contains(page, `data-field="created_before">`) {
		t.Fatalf("the confirmation page: %d\n%s", code, page)
	}
	if code, _, page := b.get("/ui/bulk?kind=cancel&state=final&key_prefix=a-"); code != http.StatusBadRequest || !strings.Contains(page, "filter.state") {
		t.Errorf("a cancel of final jobs: %d, want 400 naming filter.state", code)
	}
	form := url.Values{}
	for _, m := range regexp.MustCompile(`<input type="hidden" name="([a-z_]+)" value="([^"]*)">`).FindAllStringSubmatch(page, -1) {
		form.Set(m[1], html.UnescapeString(m[2]))
	}
	if form.Get("created_before") == "" || form.Get("csrf") == "" || form.Get("kind") != "cancel" {
		t.Fatalf("the form: %v", form)
	}
	// A job created after the page was made is not acted on.
	e.want("PUT", "/v1/jobs/t/a-4", `{}`, 201)
	wrong := url.Values{}
	for k, v := range form {
		wrong[k] = v
	}
	wrong.Set("csrf", strings.Repeat("0", 64))
	wrong.Set("reason", "x")
	if resp := b.post("/ui/act/bulk", wrong); resp.StatusCode != http.StatusForbidden {
		t.Errorf("a wrong CSRF token: %d", resp.StatusCode)
	}
	resp := b.post("/ui/act/bulk", form) // no reason
	if loc, _ := url.Parse(resp.Header.Get("Location")); !strings.Contains(loc.Query().Get("flash"), "✗ bulk: reason: required") {
		t.Errorf("without a reason: to %s", resp.Header.Get("Location"))
	}
	form.Set("reason", "tenant a left")
	resp = b.post("/ui/act/bulk", form)
	loc, _ := url.Parse(resp.Header.Get("Location"))
	if f := loc.Query().Get("flash"); loc.Path != "/ui/jobs" || !strings.Contains(f, "✓ jobs.cancel: operation 1 done: matched 3, done 3, skipped 0") {
		t.Fatalf("after the action: to %s (%q)", loc, f)
	}
	for k, want := range map[string]string{"a-1": "final", "a-3": "final", "a-4": "initial", "b-1": "initial"} {
		if j := job(e.want("GET", "/v1/jobs/t/"+k, "", 200)); j["state"] != want {
			t.Errorf("%s: %v, want %s", k, j["state"], want)
		}
	}
	if op, err := e.st.OperationGet(ctx, 1); err != nil || op.TokenName != nameOf(token) || op.Reason != "tenant a left" {
		t.Errorf("the operation: %+v %v", op, err)
	}

	// Dead letters by source.
	if err := e.st.DeadLetterInsert(ctx, []store.DeadLetter{{Kind: store.SourceIntake, Reason: "unknown_job_type: t",
		Source: store.Source{Value: []byte(`{"job_type": "t", "job_key": "dl"}`)}}}); err != nil {
		t.Fatal(err)
	}
	if _, _, dl := b.get("/ui/dead-letters?source=intake"); !strings.Contains(dl, `data-count="matching">1<`) || !strings.Contains(dl, `data-bulk="dead-letters-replay"`) {
		t.Fatalf("the dead letters of a source offer no bulk replay:\n%s", dl)
	}
	if code, _, page := b.get("/ui/bulk?kind=dead-letters-replay&source=intake"); code != 200 || !strings.Contains(page, `<span id="bulk-count">1</span>`) ||
		!strings.Contains(page, `data-field="received_before">`) {
		t.Fatalf("the dead letters' confirmation page: %d\n%s", code, page)
	}

	// The read role.
	rb := newBrowser(t, e.url, nil)
	rb.signIn(read)
	if _, _, list := rb.get("/ui/jobs?key_prefix=b-"); strings.Contains(list, `id="bulk-actions"`) {
		t.Error("the read role is offered a bulk action")
	}
	if code, _, _ := rb.get("/ui/bulk?kind=cancel&key_prefix=b-"); code != http.StatusForbidden {
		t.Errorf("the read role's confirmation page: %d, want 403", code)
	}
	_, _, queues := rb.get("/ui/queues")
	rform := url.Values{"csrf": {csrfField.FindStringSubmatch(queues)[1]}, "kind": {"cancel"}, "key_prefix": {"b-"}, "reason": {"x"}}
	if resp := rb.post("/ui/act/bulk", rform); resp.StatusCode != http.StatusForbidden {
		t.Errorf("the read role's bulk action: %d, want 403", resp.StatusCode)
	}
	if j := job(e.want("GET", "/v1/jobs/t/b-1", "", 200)); j["state"] != "initial" {
		t.Errorf("b-1 after the read role's try: %v", j["state"])
	}
}

// The overview shows the outcome events waiting to be relayed, by topic.
func TestDashboardShowsPendingEvents(t *testing.T) {
	t.Parallel()
	e := newAPIConfig(t, func(c *Config) { c.UI = &UIConfig{} })
	if _, err := e.st.Pool().Exec(ctx, `INSERT INTO hipq_event (queue, topic, job_id, job_type, job_key, attempt, outcome, value)
		SELECT 'default', 'outcomes', i, 't', 'k' || i, 1, 'succeeded', '{}' FROM generate_series(1, 3) i`); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get(e.url + "/ui/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `data-count="events-outcomes">3<`) {
		t.Fatalf("overview %d without the pending events of topic outcomes:\n%s", resp.StatusCode, body)
	}
}

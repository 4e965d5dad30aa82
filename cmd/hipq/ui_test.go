package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/hipq/hipq/internal/browsertest"
	"github.com/hipq/hipq/internal/testutil"
)

const uiConfig = `
name: ui
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"], session_timeout: 6s}
intake: {topics: ["{{T:jobs}}"], dead_letter_topic: "{{T:jobs.dlq}}", max_bytes: 2048}
responses: {topics: [{topic: "{{T:replies}}"}], dead_letter_topic: "{{T:replies.dlq}}", early_ttl: 1m}
dispatch: {interval: 100ms, batch_size: 50, grace: 1s}
sweeper: {schedule: "@every 1s"}
queues:
  - name: default
  - name: bulk
    throttle_limit: 4
    shares: {by: {json: /tenant}, weights: {a: 1, "*": 1}}
job_types:
  - name: e2e
    transport: {kafka: {topic: "{{T:requests}}"}}
    reply_topic: "{{T:replies}}"
    timeout: 5m
    retry: {max_attempts: 3, backoff: fixed, initial: 200ms, jitter: 0}
  - name: bulk.e2e
    queue: bulk
    transport: {kafka: {topic: "{{T:requests}}"}}
    reply_topic: "{{T:replies}}"
    timeout: 5m
schedules:
  - {name: nightly, cron: "0 3 * * *", tz: Europe/Berlin, job_type: e2e, job_key: 'n-{{.Time.Unix}}'}
`

const (
	uiAdmin = "admin-token-0123456789-0123456789-0123456789"
	uiRead  = "read-token-0123456789-0123456789-0123456789"
	xssKey  = `<script>alert(1)</script>`
)

// The dashboard as a person uses it, in headless Chromium against a real
// hipq (PostgreSQL, kfake) mounted under a path prefix: no console error
// on any page, the counts shown are the API's, pause and resume, cancel
// and replay act as the API does, a bulk cancel of all matching is counted,
// confirmed and done, a hostile key is text, CSRF and the read role are
// enforced, and a screenshot of the overview with live traffic.
func TestDashboardInBrowser(t *testing.T) {
	t.Parallel()
	browser := browsertest.New(t) // skips without Chromium
	e := newEnv(t, e2eTopics...)
	text, api := withAPI(t, uiConfig, fmt.Sprintf(`, tokens: [%q], read_tokens: [%q], ui: {path_prefix: /ops, redact: [/secret]}`, uiAdmin, uiRead))
	a := e.start(e.config(text))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The downstream answers every job but those it keeps running.
	e.respond(ctx, "requests", "replies", func(key string, attempt int) (string, bool) {
		return "succeeded", !strings.HasPrefix(key, "hang") && key != xssKey
	})
	waitAPI(t, api)
	base := api + "/ops/ui"

	var reqs []string
	for i := range 20 {
		reqs = append(reqs, jobReq(fmt.Sprintf("ok-%d", i)))
	}
	for i := range 3 {
		reqs = append(reqs, fmt.Sprintf(`{"job_type":"bulk.e2e","job_key":"hang-%d","job_data":{"tenant":"a","secret":"s3cr3t"}}`, i))
	}
	reqs = append(reqs, jobReq(xssKey), `{"job_type": "e2e", "job_key": 7}`)
	e.produce("jobs", reqs...)
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		f, r := e.countJobs(a, "state = 'final'"), e.countJobs(a, "state = 'running'")
		var states string
		_ = a.st.Pool().QueryRow(context.Background(), `SELECT string_agg(job_key || '=' || state, ' ') FROM hipq_job WHERE state <> 'final' OR job_key NOT LIKE 'ok-%'`).Scan(&states)
		return f == 20 && r == 3, fmt.Sprintf("%d final, %d running: %s", f, r, states)
	}, "the jobs settled (hang-2 waits: tenant a may run 2 of bulk's 4)")

	tab := browser.Tab()
	do := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(tab.Ctx, steps...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	// click presses a button or link that loads a page, and waits for it.
	click := func(what, sel string) {
		t.Helper()
		if _, err := chromedp.RunResponse(tab.Ctx, chromedp.Click(chromedp.CSS(sel))); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	textOf := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(tab.Ctx, chromedp.TextContent(chromedp.CSS(sel)))
		if err != nil {
			t.Fatalf("text of %s: %v", sel, err)
		}
		return strings.TrimSpace(s)
	}
	eval := func(js string) int {
		t.Helper()
		n, err := chromedp.Run(tab.Ctx, chromedp.Evaluate[int](js))
		if err != nil {
			t.Fatalf("%s: %v", js, err)
		}
		return n
	}
	noErrors := func(page string) {
		t.Helper()
		if errs := tab.Errors(); len(errs) > 0 {
			t.Errorf("%s: the browser reported %q", page, errs)
		}
	}

	// Signing in: the overview sends to the login page, and back.
	do("open the overview", chromedp.Navigate(base+"/"))
	if loc, _ := chromedp.Run(tab.Ctx, chromedp.Location()); !strings.Contains(loc, "/ops/ui/login") {
		t.Fatalf("without a session the overview is at %s, want the login page", loc)
	}
	do("type the token", chromedp.SendKeys(chromedp.CSS(`input[name=token]`), uiAdmin))
	click("sign in", `form.login button`)
	if got := textOf("h1"); !strings.HasPrefix(got, "Overview") {
		t.Fatalf("after signing in: %q", got)
	}
	noErrors("overview")

	// The counts shown are the API's.
	for _, q := range []string{"default", "bulk"} {
		for _, st := range []string{"initial", "retry", "running"} {
			shown := textOf(fmt.Sprintf(`#queue-%s [data-count=%s]`, q, st))
			if want := apiCount(t, api, q, st); shown != strconv.Itoa(want) {
				t.Errorf("queue %s, %s: the overview shows %s, the API lists %d", q, st, shown, want)
			}
		}
	}
	if got := textOf(`[data-count=dead-letters]`); got != "1" {
		t.Errorf("dead letters of the last 24 h: %s, want 1", got)
	}

	// Every page, without a console error; the hostile key is text.
	for _, p := range []string{"/jobs", "/jobs?queue=bulk&state=running", "/jobs?key_prefix=ok-1", "/dead-letters", "/queues", "/schedules"} {
		do("open "+p, chromedp.Navigate(base+p))
		noErrors(p)
	}
	do("filter by key prefix", chromedp.Navigate(base+"/jobs?key_prefix=ok-1"))
	if n := eval(`document.querySelectorAll("table.jobs tbody tr").length`); n != 11 { // ok-1, ok-10 … ok-19
		t.Errorf("key prefix ok-1: %d rows, want 11", n)
	}
	do("open the hostile job", chromedp.Navigate(base+"/job?job_type=e2e&job_key="+url.QueryEscape(xssKey)))
	if got := textOf("#job-key"); got != xssKey {
		t.Errorf("the key shows as %q", got)
	}
	if n := eval(`document.querySelectorAll("main script").length`); n != 0 {
		t.Errorf("%d script elements in the job page's content", n)
	}
	noErrors("the hostile job") // an alert would be a dialog, reported here

	// Redaction of job_data.
	do("open a bulk job", chromedp.Navigate(base+"/job?job_type=bulk.e2e&job_key=hang-2"))
	if data := textOf("main pre"); strings.Contains(data, "s3cr3t") || !strings.Contains(data, "[redacted]") {
		t.Errorf("job_data shown as %s: /secret not redacted", data)
	}

	if ok, err := chromedp.Run(tab.Ctx, chromedp.Evaluate[bool](`document.body.innerText.includes("hipq-reply-to")`)); err != nil || !ok {
		t.Errorf("the job page does not show the request's reply-to header (%v)", err)
	}

	// Pause and resume.
	do("open the queues", chromedp.Navigate(base+"/queues"))
	click("pause default", `#queue-default form button`)
	if !queuePaused(t, api, "default") {
		t.Error("Pause clicked: the API says default is not paused")
	}
	if got := textOf(".flash"); !strings.Contains(got, "pause") {
		t.Errorf("after pausing the page says %q", got)
	}
	click("resume default", `#queue-default form button`)
	if queuePaused(t, api, "default") {
		t.Error("Resume clicked: the API says default is still paused")
	}
	noErrors("queues")

	// Cancel, then replay, from the job page.
	do("open hang-1", chromedp.Navigate(base+"/job?job_type=bulk.e2e&job_key=hang-1"))
	click("cancel hang-1", `form[action$="/act/cancel"] button`)
	if j := apiJob(t, api, "bulk.e2e", "hang-1"); j.State != "final" || j.Outcome != "cancelled" {
		t.Errorf("after Cancel the API shows %+v", j)
	}
	click("replay hang-1", `form[action$="/act/replay"] button`)
	if j := apiJob(t, api, "bulk.e2e", "hang-1"); j.State == "final" {
		t.Errorf("after Replay the API shows %+v, want a new non-final job", j)
	}
	noErrors("job page actions")

	// Act on all matching: the bulk queue's hang-* jobs (hang-1's two),
	// counted on the list, confirmed with their count and filter, then
	// cancelled by the form; the hostile key's job in the default queue,
	// outside the filter, runs on.
	do("filter the bulk queue's hang jobs", chromedp.Navigate(base+"/jobs?queue=bulk&key_prefix=hang-"))
	if n, rows := textOf(`[data-count=matching]`), eval(`document.querySelectorAll("table.jobs tbody tr").length`); n != strconv.Itoa(rows) || rows != 4 {
		t.Errorf("the list says %s match and shows %d rows, want 4", n, rows)
	}
	click("cancel all matching", `[data-bulk=cancel]`)
	if got := textOf("#bulk-count"); got != "3" {
		t.Errorf("the confirmation counts %s jobs to cancel, want 3 (hang-0, hang-1's new job, hang-2)", got)
	}
	if q, k := textOf(`[data-field=queue]`), textOf(`[data-field=key_prefix]`); q != "bulk" || k != "hang-" {
		t.Errorf("the confirmation shows the filter queue=%s key_prefix=%s", q, k)
	}
	noErrors("the bulk confirmation")
	do("give the reason", chromedp.SendKeys(chromedp.CSS(`form.bulk input[name=reason]`), "tenant a's backlog"))
	click("confirm", `form.bulk button`)
	if got := textOf(".flash"); !strings.Contains(got, "jobs.cancel") || !strings.Contains(got, "matched 3, done 3, skipped 0") {
		t.Errorf("after the bulk cancel the page says %q", got)
	}
	for _, k := range []string{"hang-0", "hang-1", "hang-2"} {
		if j := apiJob(t, api, "bulk.e2e", k); j.State != "final" || j.Outcome != "cancelled" {
			t.Errorf("%s after the bulk cancel: %+v", k, j)
		}
	}
	if j := apiJob(t, api, "e2e", url.PathEscape(xssKey)); j.State == "final" {
		t.Errorf("a job outside the filter was cancelled: %+v", j)
	}
	noErrors("bulk cancel")

	// CSRF: the admin session's POST without the form's token is refused.
	jar, _ := cookiejar.New(nil)
	hc := &http.Client{Jar: jar}
	adminCSRF := login(t, hc, base, uiAdmin)
	if code, _ := post(t, hc, base+"/act/pause", url.Values{"queue": {"default"}}); code != http.StatusForbidden {
		t.Errorf("a POST without the CSRF token: %d, want 403", code)
	}
	if code, _ := post(t, hc, base+"/act/pause", url.Values{"queue": {"default"}, "csrf": {adminCSRF[:len(adminCSRF)-1] + flip(adminCSRF[len(adminCSRF)-1])}}); code != http.StatusForbidden {
		t.Errorf("a POST with a wrong CSRF token: %d, want 403", code)
	}
	if queuePaused(t, api, "default") {
		t.Error("a POST without the CSRF token paused the queue")
	}

	// The read role: no buttons, and its POSTs are refused even with the
	// CSRF token.
	reader := browser.Tab()
	tab = reader
	do("open the login page", chromedp.Navigate(base+"/login"))
	do("type the read token", chromedp.SendKeys(chromedp.CSS(`input[name=token]`), uiRead))
	click("sign in", `form.login button`)
	for _, p := range []string{"/", "/queues", "/schedules", "/dead-letters", "/dead-letters?source=intake", "/jobs?queue=bulk",
		"/job?job_type=e2e&job_key=ok-3"} {
		do("open "+p, chromedp.Navigate(base+p))
		if n := eval(`document.querySelectorAll('form[action*="/act/"], [data-bulk]').length`); n != 0 {
			t.Errorf("%s: the read role sees %d action buttons", p, n)
		}
		noErrors("read role " + p)
	}
	rjar, _ := cookiejar.New(nil)
	rc := &http.Client{Jar: rjar}
	csrf := login(t, rc, base, uiRead)
	if code, body := post(t, rc, base+"/act/pause", url.Values{"queue": {"default"}, "csrf": {csrf}}); code != http.StatusForbidden ||
		!strings.Contains(body, "only an admin token") {
		t.Errorf("the read role's POST with its CSRF token: %d %q, want 403 for its role", code, body)
	}
	if queuePaused(t, api, "default") {
		t.Error("the read role paused the queue")
	}
	// Only under the prefix.
	if resp, err := http.Get(api + "/ui/"); err == nil {
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("/ui/ without the prefix: %d, want 404", resp.StatusCode)
		}
	}

	// Live traffic, then a screenshot of the overview once its chart has
	// points (instances write their counts every few seconds).
	go func() {
		for i := 0; ctx.Err() == nil; i++ {
			e.produce("jobs", jobReq(fmt.Sprintf("live-%d", i)), fmt.Sprintf(`{"job_type":"bulk.e2e","job_key":"live-%d","job_data":{"tenant":"b"}}`, i))
			time.Sleep(20 * time.Millisecond)
		}
	}()
	tab = browser.Tab()
	do("open the login page", chromedp.Navigate(base+"/login"))
	do("type the token", chromedp.SendKeys(chromedp.CSS(`input[name=token]`), uiAdmin))
	click("sign in", `form.login button`)
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		do("reload", chromedp.Navigate(base+"/"))
		s := textOf("#queue-default .legend .sent")
		return s != "sent 0", s
	}, "the chart has traffic")
	shot, err := chromedp.Run(tab.Ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	out := os.Getenv("HIPQ_UI_SCREENSHOT")
	if out == "" {
		out = t.TempDir() + "/overview.png"
	}
	if err := os.WriteFile(out, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot of the overview: %s (%d bytes)", out, len(shot))
	noErrors("overview with traffic")
}

// apiCount counts a queue's jobs in a state through the API's list.
func apiCount(t *testing.T, api, queue, state string) int {
	t.Helper()
	var out struct {
		Jobs []json.RawMessage `json:"jobs"`
	}
	apiGet(t, api+"/v1/jobs?limit=1000&queue="+queue+"&state="+state, &out)
	return len(out.Jobs)
}

type uiJob struct {
	State   string `json:"state"`
	Outcome string `json:"outcome"`
}

func apiJob(t *testing.T, api, jobType, key string) uiJob {
	t.Helper()
	var out struct{ Job uiJob }
	apiGet(t, api+"/v1/jobs/"+jobType+"/"+key, &out)
	return out.Job
}

func queuePaused(t *testing.T, api, queue string) bool {
	t.Helper()
	var out struct {
		Queues []struct {
			Name   string
			Paused bool
		}
	}
	apiGet(t, api+"/v1/queues", &out)
	for _, q := range out.Queues {
		if q.Name == queue {
			return q.Paused
		}
	}
	t.Fatalf("queue %s not in GET /v1/queues", queue)
	return false
}

func apiGet(t *testing.T, u string, v any) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	req.Header.Set("Authorization", "Bearer "+uiRead)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %s", u, resp.StatusCode, body)
	}
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// login signs c in with token and returns the CSRF token of its pages.
func login(t *testing.T, c *http.Client, base, token string) string {
	t.Helper()
	resp, err := c.Get(base + "/login")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := csrfField.FindSubmatch(body)
	if m == nil {
		t.Fatalf("no CSRF token on the login page: %s", body)
	}
	if code, _ := post(t, c, base+"/login", url.Values{"token": {token}, "csrf": {string(m[1])}}); code != http.StatusOK {
		t.Fatalf("sign in: %d", code)
	}
	// The session's own CSRF token (the sign-in page's is worth nothing now).
	resp, err = c.Get(base + "/queues")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if bu, _ := url.Parse(base); csrfField.FindSubmatch(body) == nil || resp.Request.URL.Path != bu.Path+"/queues" {
		t.Fatalf("not signed in: at %s", resp.Request.URL)
	}
	return string(csrfField.FindSubmatch(body)[1])
}

// post sends a form and returns the status after redirects, and the body.
func post(t *testing.T, c *http.Client, u string, form url.Values) (int, string) {
	t.Helper()
	resp, err := c.PostForm(u, form)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// flip is another hex digit.
func flip(c byte) string {
	if c == '0' {
		return "1"
	}
	return "0"
}

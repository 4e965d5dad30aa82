package api

// The dashboard: HTML pages at {prefix}/ui/ for the person on call, served
// by the API from html/template and embedded files. Pages work without
// JavaScript; ui.js (ours, embedded) only refreshes the overview in place.
//
// Security: the same tokens as the API, typed once on the login page. A
// sign-in makes a session: a random id in an HttpOnly, SameSite=Strict
// cookie, stored hashed in PostgreSQL (so every instance knows it) with
// the HMAC of the token and its role, and an expiry that slides while it
// is used. Each request checks that token is still configured with that
// role. The read role sees no buttons and its POSTs are refused. Every
// POST carries a CSRF token, the HMAC of a random per-browser cookie and
// of the session's id (so it needs no server state of its own). The
// Content-Security-Policy allows nothing but the dashboard's own files: no
// inline script or style.

import (
	"bytes"
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

//go:embed ui/*.html ui/static/*
var uiFiles embed.FS

// UIConfig configures the dashboard; nil in Config means no dashboard.
type UIConfig struct {
	// PathPrefix is where a reverse proxy mounts hipq ("" or like /hipq):
	// the dashboard is at {PathPrefix}/ui/.
	PathPrefix string
	// Redact lists JSON pointers of job_data fields shown as "[redacted]".
	Redact []string
	// Throttles are the queues' limits, shown against their running weight.
	Throttles map[string]*correlator.Throttle
	// Lag reports the consumer groups' lag; nil: not shown.
	Lag func(context.Context) ([]GroupLag, error)
	// Requests describe, by job type, the request hipq sends, for the job
	// page.
	Requests map[string]RequestShape
	// SecureCookies marks the cookies Secure whatever the request says
	// (api.public_url is https: a TLS proxy in front); otherwise only
	// requests over TLS or with X-Forwarded-Proto: https get them.
	SecureCookies bool
	// SessionTTL is how long a session lasts unused; each use moves its
	// end to SessionTTL from then. Defaults to DefaultSessionTTL.
	SessionTTL time.Duration
}

// DefaultSessionTTL is how long a dashboard session lasts unused.
const DefaultSessionTTL = 12 * time.Hour

// RequestShape is how a job type's requests are sent: transport (kafka or
// http), target (the topic, or the method and URL without its secrets),
// the reply topic named in a header, and the names of the configured
// headers (never their values).
type RequestShape struct {
	Transport  string
	Target     string
	ReplyTopic string
	Headers    []string
}

// GroupLag is a consumer group's lag on one topic: records between the
// partitions' end offsets and the offsets stored in PostgreSQL.
type GroupLag struct {
	Group      string
	Topic      string
	Partitions int
	Records    int64
}

const (
	uiSessionCookie = "hipq_ui_session" // the session's random id
	uiNonceCookie   = "hipq_ui_nonce"   // the CSRF token is its HMAC
	uiCSP           = "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
	redacted        = "[redacted]"
)

// ui is the dashboard's state.
type ui struct {
	s       *Server
	cfg     UIConfig
	base    string // {prefix}/ui
	pages   map[string]*template.Template
	csrfKey []byte
	// tokens are the configured tokens' hashes (tokenHash) and roles:
	// what a stored session is checked against; names their names, as
	// the API logs them.
	tokens map[string]role
	names  map[string]string
	counts countCache
}

// mountUI registers the dashboard's routes on the server's mux.
func (s *Server) mountUI(cfg UIConfig) {
	u := &ui{s: s, cfg: cfg, base: cfg.PathPrefix + "/ui", pages: map[string]*template.Template{}}
	// The dashboard's own key, derived from the callback secret (shared
	// by every instance), so no signature of one purpose serves another.
	secret := s.cfg.CallbackSecret
	if len(secret) == 0 {
		secret = make([]byte, 32)
		_, _ = rand.Read(secret)
	}
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("hipq dashboard key"))
	u.csrfKey = m.Sum(nil)
	u.cfg.SessionTTL = cmp.Or(u.cfg.SessionTTL, DefaultSessionTTL)
	u.tokens, u.names = map[string]role{}, map[string]string{}
	for _, t := range s.cfg.ReadTokens {
		u.tokens[string(u.tokenHash(t))] = roleRead
		u.names[string(u.tokenHash(t))] = nameOf(t)
	}
	for _, t := range s.cfg.Tokens { // a token in both lists is admin, as in the API
		u.tokens[string(u.tokenHash(t))] = roleAdmin
		u.names[string(u.tokenHash(t))] = nameOf(t)
	}
	funcs := template.FuncMap{
		"link":     u.link,
		"ago":      ago,
		"when":     when,
		"pretty":   pretty,
		"deref":    deref,
		"add":      func(a, b int) int { return a + b },
		"pct":      func(a, b int64) int64 { return a * 100 / max(b, 1) },
		"contains": slices.Contains[[]string],
		"args": func(kv ...any) map[string]any { // a template's named arguments
			m := map[string]any{}
			for i := 0; i+1 < len(kv); i += 2 {
				m[fmt.Sprint(kv[i])] = kv[i+1]
			}
			return m
		},
	}
	layout := template.Must(template.New("layout.html").Funcs(funcs).ParseFS(uiFiles, "ui/layout.html"))
	for _, p := range []string{"login", "overview", "jobs", "job", "deadletters", "queues", "schedules", "bulk", "error"} {
		u.pages[p] = template.Must(template.Must(layout.Clone()).ParseFS(uiFiles, "ui/"+p+".html"))
	}
	static, _ := fs.Sub(uiFiles, "ui/static")
	files := http.StripPrefix(u.base+"/static/", http.FileServerFS(static))
	s.route("GET "+u.base+"/static/{file}", u.headers(files)) // files only: no listing
	s.route("GET "+u.base, u.headers(http.RedirectHandler(u.base+"/", http.StatusSeeOther)))
	s.route(u.base+"/", u.headers(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		v := &view{Base: u.base, Page: "error", Title: "Not found", Data: "No such page of the dashboard."}
		u.render(w, http.StatusNotFound, v)
	})))
	s.route("GET "+u.base+"/{$}", u.page(u.overview))
	s.route("GET "+u.base+"/login", u.headers(http.HandlerFunc(u.loginForm)))
	s.route("POST "+u.base+"/login", u.headers(http.HandlerFunc(u.login)))
	s.route("POST "+u.base+"/logout", u.headers(http.HandlerFunc(u.logout)))
	s.route("GET "+u.base+"/jobs", u.page(u.jobs))
	s.route("GET "+u.base+"/job", u.page(u.job))
	s.route("GET "+u.base+"/dead-letters", u.page(u.deadLetters))
	s.route("GET "+u.base+"/queues", u.page(u.queues))
	s.route("GET "+u.base+"/schedules", u.page(u.schedules))
	s.route("GET "+u.base+"/bulk", u.page(u.bulkConfirm))
	s.route("POST "+u.base+"/act/{action}", u.headers(http.HandlerFunc(u.act)))
}

// headers sets the security headers of every dashboard answer.
func (u *ui) headers(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hd := w.Header()
		hd.Set("Content-Security-Policy", uiCSP)
		hd.Set("X-Content-Type-Options", "nosniff")
		hd.Set("Referrer-Policy", "same-origin")
		hd.Set("X-Frame-Options", "DENY")
		if !strings.Contains(r.URL.Path, "/static/") {
			hd.Set("Cache-Control", "no-store")
		}
		h.ServeHTTP(w, r)
	})
}

// view is what every page template gets.
type view struct {
	Base    string
	Title   string
	Page    string
	Admin   bool
	CSRF    string
	Flash   string
	FlashOK bool
	Live    bool
	Data    any
}

// page serves a GET page: the session's role (else the login page), the
// CSRF token, the page's data, the template.
func (u *ui) page(fn func(*http.Request, *view) error) http.Handler {
	return u.headers(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), u.s.cfg.RequestTimeout)
		defer cancel()
		r = r.WithContext(ctx)
		rl, err := u.role(r)
		if err != nil {
			u.fail(w, r, &view{Base: u.base}, err)
			return
		}
		if rl == roleNone {
			http.Redirect(w, r, u.base+"/login?next="+url.QueryEscape(r.URL.RequestURI()), http.StatusSeeOther)
			return
		}
		v := &view{Base: u.base, Admin: rl == roleAdmin, CSRF: u.csrf(w, r)}
		if f := r.URL.Query().Get("flash"); f != "" && hmac.Equal([]byte(r.URL.Query().Get("fs")), []byte(u.sign("ui-flash", f))) {
			v.Flash, v.FlashOK = correlator.Clip(f, 500), strings.HasPrefix(f, "✓ ")
		}
		if err := fn(r, v); err != nil {
			u.fail(w, r, v, err)
			return
		}
		u.render(w, http.StatusOK, v)
	}))
}

// fail shows an error page: a bad parameter as such, anything else logged
// and shown without detail.
func (u *ui) fail(w http.ResponseWriter, r *http.Request, v *view, err error) {
	status, msg := http.StatusInternalServerError, "internal error; see hipq's log"
	var ae *apiError
	switch {
	case errors.As(err, &ae):
		status, msg = ae.Status, ae.Message
	case errors.Is(err, context.DeadlineExceeded) || store.IsTransient(err):
		status, msg = http.StatusServiceUnavailable, "PostgreSQL did not answer in time; try again"
	default:
		u.s.log.Error("dashboard page failed", zap.String("path", correlator.Clip(r.URL.Path, 512)), zap.Error(err))
	}
	v.Page, v.Title, v.Data = "error", "Error", msg
	u.render(w, status, v)
}

func (u *ui) render(w http.ResponseWriter, status int, v *view) {
	var b bytes.Buffer
	if err := u.pages[v.Page].ExecuteTemplate(&b, "layout.html", v); err != nil {
		u.s.log.Error("dashboard template failed", zap.String("page", v.Page), zap.Error(err))
		http.Error(w, "template error; see hipq's log", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(b.Bytes())
}

// role is the session's role: with no tokens configured everyone is admin.
// A session whose token is no longer configured with the role it signed in
// with is deleted: it stays ended if the token comes back.
func (u *ui) role(r *http.Request) (role, error) {
	rl, _, err := u.who(r)
	return rl, err
}

// who is the session's role and the name of its token (as the API names
// tokens in its log).
func (u *ui) who(r *http.Request) (role, string, error) {
	if len(u.s.cfg.Tokens) == 0 {
		return roleAdmin, u.s.tokenName(r), nil
	}
	id := u.sessionID(r)
	if id == nil {
		return roleNone, "", nil
	}
	sess, err := u.s.st.UISessionTouch(r.Context(), id, u.cfg.SessionTTL, min(time.Minute, u.cfg.SessionTTL/2))
	if err != nil || sess == nil {
		return roleNone, "", err
	}
	configured, name := roleNone, ""
	for h, rl := range u.tokens {
		if subtle.ConstantTimeCompare([]byte(h), sess.TokenHash) == 1 {
			configured, name = rl, u.names[h]
		}
	}
	if configured == roleNone || configured.String() != sess.Role {
		u.s.log.Info("dashboard session ended: its token is no longer configured with its role", zap.String("role", sess.Role))
		return roleNone, "", u.s.st.UISessionDelete(r.Context(), id)
	}
	return configured, name, nil
}

// String names a role as sessions store it.
func (rl role) String() string {
	switch rl {
	case roleAdmin:
		return "admin"
	case roleRead:
		return "read"
	}
	return "none"
}

// tokenHash is what a session keeps of its token: its HMAC under the
// dashboard's key, never the token.
func (u *ui) tokenHash(token string) []byte {
	m := hmac.New(sha256.New, u.csrfKey)
	m.Write([]byte("ui-session-token\n" + token))
	return m.Sum(nil)
}

// csrf returns the request's CSRF token, setting the nonce cookie it is
// made from when the browser has none yet. The token is bound to the
// nonce and to the session (a token of one session, or of the sign-in
// page, is worth nothing in another).
func (u *ui) csrf(w http.ResponseWriter, r *http.Request) string {
	if c, err := r.Cookie(uiNonceCookie); err == nil && len(c.Value) == 32 {
		return u.csrfOf(c.Value, u.session(r))
	}
	nonce := u.newNonce(w, r)
	return u.csrfOf(nonce, u.session(r))
}

func (u *ui) newNonce(w http.ResponseWriter, r *http.Request) string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	nonce := hex.EncodeToString(b)
	http.SetCookie(w, u.cookie(r, uiNonceCookie, nonce))
	return nonce
}

func (u *ui) csrfOf(nonce, session string) string {
	return u.sign("ui-csrf", nonce+"\n"+session)
}

// sign is the hex HMAC of a purpose and a value under the dashboard's key.
func (u *ui) sign(purpose, value string) string {
	m := hmac.New(sha256.New, u.csrfKey)
	m.Write([]byte(purpose + "\n" + value))
	return hex.EncodeToString(m.Sum(nil))
}

// csrfValid checks a POST's csrf field against the nonce cookie and the
// session.
func (u *ui) csrfValid(r *http.Request) bool {
	c, err := r.Cookie(uiNonceCookie)
	if err != nil || len(c.Value) != 32 {
		return false
	}
	return hmac.Equal([]byte(r.PostFormValue("csrf")), []byte(u.csrfOf(c.Value, u.session(r))))
}

// session is the session cookie's value ("" when signed out): the
// session's random id, to which CSRF tokens are bound.
func (u *ui) session(r *http.Request) string {
	c, err := r.Cookie(uiSessionCookie)
	if err != nil {
		return ""
	}
	return c.Value
}

// sessionID is the hash of the session's id, as stored (nil when the
// request has no well-formed session cookie).
func (u *ui) sessionID(r *http.Request) []byte {
	b, err := base64.RawURLEncoding.DecodeString(u.session(r))
	if err != nil || len(b) != sessionIDBytes {
		return nil
	}
	h := sha256.Sum256(b)
	return h[:]
}

// sessionIDBytes is the length of a session's random id.
const sessionIDBytes = 32

func (u *ui) cookie(r *http.Request, name, value string) *http.Cookie {
	return &http.Cookie{Name: name, Value: value, Path: u.base + "/", HttpOnly: true, SameSite: http.SameSiteStrictMode,
		Secure: u.cfg.SecureCookies || r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https"}
}

func (u *ui) loginForm(w http.ResponseWriter, r *http.Request) {
	v := &view{Base: u.base, Page: "login", Title: "Sign in", CSRF: u.csrf(w, r), Data: u.next(r.URL.Query().Get("next"))}
	if r.URL.Query().Get("failed") == "1" {
		v.Flash = "That token is not one of api.tokens or api.read_tokens."
	}
	u.render(w, http.StatusOK, v)
}

// next keeps a redirect inside the dashboard.
func (u *ui) next(n string) string {
	if !strings.HasPrefix(n, u.base+"/") || strings.HasPrefix(n, "//") || strings.ContainsAny(n, "\\\r\n") {
		return u.base + "/"
	}
	return n
}

func (u *ui) login(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if !u.csrfValid(r) {
		http.Error(w, "forbidden: the form's CSRF token is missing or wrong; reload the page", http.StatusForbidden)
		return
	}
	token := strings.TrimSpace(r.PostFormValue("token"))
	next := u.next(r.PostFormValue("next"))
	if len(u.s.cfg.Tokens) == 0 { // no sign-in needed: no session
		http.Redirect(w, r, next, http.StatusSeeOther)
		return
	}
	rl := u.s.roleOf(token)
	if rl == roleNone {
		u.s.log.Warn("dashboard sign-in refused", zap.String("remote", r.RemoteAddr))
		http.Redirect(w, r, u.base+"/login?failed=1&next="+url.QueryEscape(next), http.StatusSeeOther)
		return
	}
	// A new random id, and a new nonce: nothing of the signed-out browser
	// carries over into the session. The browser's previous session, if
	// any, ends.
	id := make([]byte, sessionIDBytes)
	_, _ = rand.Read(id)
	idHash := sha256.Sum256(id)
	ctx, cancel := context.WithTimeout(r.Context(), u.s.cfg.RequestTimeout)
	defer cancel()
	err := u.s.st.UISessionCreate(ctx, idHash[:], store.UISession{TokenHash: u.tokenHash(token), Role: rl.String()},
		u.cfg.SessionTTL, u.sessionID(r))
	if err != nil {
		u.fail(w, r, &view{Base: u.base}, err)
		return
	}
	http.SetCookie(w, u.cookie(r, uiSessionCookie, base64.RawURLEncoding.EncodeToString(id)))
	u.newNonce(w, r)
	http.Redirect(w, r, next, http.StatusSeeOther)
}

// logout ends the session on the server, so its cookie, kept or copied,
// signs in no one, and clears the cookie.
func (u *ui) logout(w http.ResponseWriter, r *http.Request) {
	if !u.csrfValid(r) {
		http.Error(w, "forbidden: the form's CSRF token is missing or wrong; reload the page", http.StatusForbidden)
		return
	}
	if id := u.sessionID(r); id != nil {
		ctx, cancel := context.WithTimeout(r.Context(), u.s.cfg.RequestTimeout)
		defer cancel()
		if err := u.s.st.UISessionDelete(ctx, id); err != nil {
			u.fail(w, r, &view{Base: u.base}, err)
			return
		}
	}
	c := u.cookie(r, uiSessionCookie, "")
	c.MaxAge = -1
	http.SetCookie(w, c)
	http.Redirect(w, r, u.base+"/login", http.StatusSeeOther)
}

// act runs a POST action through the API's own handler, so the dashboard
// changes a job exactly as the API would, then goes back to the page it
// came from with what happened.
func (u *ui) act(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if !u.csrfValid(r) {
		http.Error(w, "forbidden: the form's CSRF token is missing or wrong; reload the page", http.StatusForbidden)
		return
	}
	rl, name, err := u.who(r)
	if err != nil {
		u.fail(w, r, &view{Base: u.base}, err)
		return
	}
	if rl != roleAdmin {
		http.Error(w, "forbidden: only an admin token (api.tokens) may change anything", http.StatusForbidden)
		return
	}
	f := r.PostFormValue
	var h func(http.ResponseWriter, *http.Request) error
	vals := map[string]string{}
	var body []byte // a JSON body, for the handlers that read one
	switch r.PathValue("action") {
	case "bulk":
		kind, ok := bulkKinds[f("kind")]
		if !ok {
			http.Error(w, "no such bulk action", http.StatusNotFound)
			return
		}
		h, body = u.s.bulk(kind), bulkBodyOf(r.PostForm, kind, f("reason"), false)
	case "cancel":
		h, vals["job_type"], vals["job_key"] = u.s.cancel, f("job_type"), f("job_key")
	case "replay":
		h, vals["job_type"], vals["job_key"] = u.s.replay, f("job_type"), f("job_key")
	case "pause", "resume":
		h, vals["queue"] = u.s.pause(r.PathValue("action") == "pause"), f("queue")
	case "dead-letter-replay":
		h, vals["id"] = u.s.replayDeadLetter, f("id")
	case "schedule-pause", "schedule-resume":
		h, vals["name"] = u.s.pauseSchedule(r.PathValue("action") == "schedule-pause"), f("name")
	case "schedule-trigger":
		h, vals["name"] = u.s.triggerSchedule, f("name")
	default:
		http.Error(w, "no such action", http.StatusNotFound)
		return
	}
	in := r.Clone(context.WithValue(r.Context(), tokenNameKey{}, name))
	in.Body, in.ContentLength = http.NoBody, 0
	if body != nil {
		in.Body, in.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
	}
	for k, v := range vals {
		in.SetPathValue(k, v)
	}
	rec := &recorder{header: http.Header{}}
	u.s.handle(func(w http.ResponseWriter, r *http.Request) error {
		if err := checkPath(r); err != nil {
			return err
		}
		return h(w, r)
	}).ServeHTTP(rec, in)
	ok := rec.status < 300
	msg := "✓ " + r.PathValue("action") + ": done"
	var answer struct {
		Error     struct{ Message string }
		Result    string
		Operation *Operation
	}
	if json.Unmarshal(rec.body.Bytes(), &answer) == nil {
		switch op := answer.Operation; {
		case !ok:
			msg = "✗ " + r.PathValue("action") + ": " + answer.Error.Message
		case answer.Result != "":
			msg += " (" + answer.Result + ")"
		case op != nil && op.State == string(store.OperationRunning):
			msg = fmt.Sprintf("✓ %s: operation %d goes on in the background (so far matched %d, done %d, skipped %d; GET /v1/operations/%d)",
				op.Kind, op.ID, op.Matched, op.Done, op.Skipped, op.ID)
		case op != nil:
			msg = fmt.Sprintf("✓ %s: operation %d %s: matched %d, done %d, skipped %d", op.Kind, op.ID, op.State, op.Matched, op.Done, op.Skipped)
		}
	}
	back := u.next(f("back"))
	sep := "?"
	if strings.Contains(back, "?") {
		sep = "&"
	}
	msg = correlator.Clip(msg, 500)
	back += sep + "flash=" + url.QueryEscape(msg) + "&fs=" + u.sign("ui-flash", msg)
	http.Redirect(w, r, back, http.StatusSeeOther)
}

// recorder keeps an in-process answer of an API handler.
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header { return r.header }
func (r *recorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.body.Write(b)
}
func (r *recorder) WriteHeader(status int) { r.status = status }

// link builds a dashboard URL: a page and query pairs (empty strings and
// zero numbers left out; a key "0" is a key).
func (u *ui) link(page string, kv ...any) string {
	q := url.Values{}
	for i := 0; i+1 < len(kv); i += 2 {
		switch v := kv[i+1].(type) {
		case string:
			if v != "" {
				q.Set(fmt.Sprint(kv[i]), v)
			}
		case int64, int:
			if fmt.Sprint(v) != "0" {
				q.Set(fmt.Sprint(kv[i]), fmt.Sprint(v))
			}
		default:
			q.Set(fmt.Sprint(kv[i]), fmt.Sprint(v))
		}
	}
	out := u.base + "/" + page
	if len(q) > 0 {
		out += "?" + q.Encode()
	}
	return out
}

func ago(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	d := time.Since(t).Round(time.Second)
	if d < 0 {
		return "in " + (-d).String()
	}
	return d.String() + " ago"
}

func when(t any) string {
	switch v := t.(type) {
	case time.Time:
		if v.IsZero() {
			return "—"
		}
		return v.UTC().Format("2006-01-02 15:04:05.000Z")
	case *time.Time:
		if v == nil {
			return "—"
		}
		return when(*v)
	}
	return ""
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// pretty indents JSON for a <pre>; other bytes are shown as text.
func pretty(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	var out bytes.Buffer
	if json.Indent(&out, b, "", "  ") != nil {
		return string(b)
	}
	return out.String()
}

// redact replaces the configured job_data fields with "[redacted]". With
// redaction configured, what it returns is always re-encoded from the
// parsed value, never the text it was given: a key repeated in that text
// (which a dead letter's record may hold) shows only the value the decoder
// kept, the one redacted. Data that does not parse is redacted whole.
func (u *ui) redact(data json.RawMessage) json.RawMessage {
	if len(u.cfg.Redact) == 0 || len(data) == 0 {
		return data
	}
	var doc any
	d := json.NewDecoder(bytes.NewReader(data))
	d.UseNumber()
	if d.Decode(&doc) != nil {
		return json.RawMessage(`"` + redacted + `"`)
	}
	if _, err := d.Token(); err != io.EOF {
		return json.RawMessage(`"` + redacted + `"`)
	}
	for _, p := range u.cfg.Redact {
		redactAt(doc, correlator.PointerTokens(p))
	}
	b, err := json.Marshal(doc)
	if err != nil {
		return json.RawMessage(`"` + redacted + `"`)
	}
	return b
}

// redactAt replaces the value at the pointer's (unescaped) tokens in doc.
func redactAt(doc any, toks []string) bool {
	tok := toks[0]
	switch d := doc.(type) {
	case map[string]any:
		v, ok := d[tok]
		if !ok {
			return false
		}
		if len(toks) == 1 {
			d[tok] = redacted
			return true
		}
		return redactAt(v, toks[1:])
	case []any:
		i, err := strconv.Atoi(tok)
		if err != nil || i < 0 || i >= len(d) {
			return false
		}
		if len(toks) == 1 {
			d[i] = redacted
			return true
		}
		return redactAt(d[i], toks[1:])
	}
	return false
}

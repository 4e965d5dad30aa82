package api

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/legacy"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/client"
	"github.com/hipq/hipq/internal/metrics"
)

// openapiDoc is api/openapi.yaml loaded and validated once, with its
// router. Its servers are dropped: the tests' servers listen elsewhere.
var openapiDoc = sync.OnceValues(func() (*openapi3.T, routers.Router) {
	doc, err := openapi3.NewLoader().LoadFromData(openapiYAML)
	if err != nil {
		panic("api/openapi.yaml: " + err.Error())
	}
	if err := doc.Validate(context.Background()); err != nil {
		panic("api/openapi.yaml is not a valid OpenAPI document: " + err.Error())
	}
	doc.Servers = nil
	router, err := legacy.NewRouter(doc)
	if err != nil {
		panic("api/openapi.yaml: " + err.Error())
	}
	return doc, router
})

// slashInSegment stands in for an escaped slash (%2F) inside one path
// segment while the document's router matches the path: ServeMux matches
// the escaped path segment by segment, so a job_key "k/1" sent as k%2F1
// is one path value, and the router must see it so too.
const slashInSegment = "\uFFFF"

// findOperation is the document's operation for r and its path values.
func findOperation(r *http.Request) (*routers.Route, map[string]string, error) {
	_, router := openapiDoc()
	segs := strings.Split(r.URL.EscapedPath(), "/")
	for i, s := range segs {
		s = strings.ReplaceAll(strings.ReplaceAll(s, "%2F", slashInSegment), "%2f", slashInSegment)
		if u, err := url.PathUnescape(s); err == nil {
			s = u
		}
		segs[i] = s
	}
	shadow := r.Clone(r.Context())
	shadow.URL.Path, shadow.URL.RawPath = strings.Join(segs, "/"), ""
	route, params, err := router.FindRoute(shadow)
	for k, v := range params {
		params[k] = strings.ReplaceAll(v, slashInSegment, "/")
	}
	return route, params, err
}

// validating serves h and checks each request and its answer against
// api/openapi.yaml, failing t on a mismatch:
//   - a request to an operation the document lacks must be answered
//     404 not_found (the answer to a path no route serves);
//   - a request the document refuses must be refused by the server too
//     (the server may refuse more: limits in bytes, cross-field rules);
//   - every answer, its status and body, must be one the document gives.
//
// The HTML dashboard (/ui/) is not in the document and is passed through.
// A request whose caller left before the answer is not checked: nobody
// reads that answer.
func validating(t testing.TB, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if isDashboard(r.URL.Path) {
			h.ServeHTTP(w, r)
			return
		}
		body, err := io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("%s %s: reading the body: %v", r.Method, r.URL, err)
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
		if r.Context().Err() != nil {
			return
		}
		if err := checkExchange(r, body, rec.Result()); err != nil {
			t.Errorf("api/openapi.yaml does not describe %s %s: %v", r.Method, r.URL, err)
		}
	})
}

// isDashboard: the path is the HTML dashboard's, {ui.path_prefix}/ui/….
func isDashboard(path string) bool {
	return !strings.HasPrefix(path, "/v1/") && (strings.HasSuffix(path, "/ui") || strings.Contains(path, "/ui/"))
}

// checkExchange validates one request and its answer against the document.
func checkExchange(r *http.Request, body []byte, resp *http.Response) error {
	respBody, _ := io.ReadAll(resp.Body)
	route, params, err := findOperation(r)
	if err != nil {
		var out struct{ Error struct{ Code string } }
		if resp.StatusCode == http.StatusNotFound && json.Unmarshal(respBody, &out) == nil && out.Error.Code == "not_found" {
			return nil
		}
		return &exchangeError{"no operation in the document, yet the server answered " + resp.Status, err}
	}
	req := r.Clone(context.Background())
	req.Body = io.NopCloser(bytes.NewReader(body))
	if len(body) > 0 && req.Header.Get("Content-Type") == "" {
		// The server reads every body as JSON whatever its Content-Type.
		req.Header.Set("Content-Type", "application/json")
	}
	opts := &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc, IncludeResponseStatus: true,
		MultiError: true}
	in := &openapi3filter.RequestValidationInput{Request: req, PathParams: params, Route: route, Options: opts}
	if err := openapi3filter.ValidateRequest(context.Background(), in); err != nil && resp.StatusCode < 400 {
		return &exchangeError{"the server accepted (" + resp.Status + ") a request the document refuses", err}
	}
	out := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: resp.StatusCode, Header: resp.Header,
		Options: opts}
	out.SetBodyBytes(respBody)
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		return &exchangeError{"the answer " + resp.Status + " " + string(respBody) + " is not one the document gives", err}
	}
	return nil
}

type exchangeError struct {
	what string
	err  error
}

func (e *exchangeError) Error() string { return e.what + ": " + e.err.Error() }

// docOperations are the document's operations as ServeMux patterns,
// "METHOD /path/{name}".
func docOperations() []string {
	doc, _ := openapiDoc()
	var out []string
	for path, item := range doc.Paths.Map() {
		for method := range item.Operations() {
			out = append(out, method+" "+path)
		}
	}
	slices.Sort(out)
	return out
}

// The route table the server registers and the document's operations
// are the same set: a route added without its description, or a
// description of a route that is gone, fails here.
func TestOpenAPIRoutes(t *testing.T) {
	t.Parallel()
	// No database is reached: New only registers routes.
	s := New(zaptest.NewLogger(t), nil, Config{Metrics: metrics.New(), UI: &UIConfig{}})
	var served []string
	for _, p := range s.patterns {
		path := p // (a pattern is "METHOD /path" or "/path")
		if _, rest, ok := strings.Cut(p, " "); ok {
			path = rest
		}
		switch {
		case p == "/":
			// The answer to every path no route serves (404 not_found),
			// described in the document's introduction, not as a path.
			continue
		case isDashboard(path):
			// The HTML dashboard is for browsers, not programs: it is
			// documented in docs/ui.md, not in the OpenAPI document.
			continue
		}
		served = append(served, p)
	}
	slices.Sort(served)
	documented := docOperations()
	for _, p := range served {
		if !slices.Contains(documented, p) {
			t.Errorf("route %q is served but not in api/openapi.yaml", p)
		}
	}
	for _, p := range documented {
		if !slices.Contains(served, p) {
			t.Errorf("api/openapi.yaml describes %q, which no route serves", p)
		}
	}
	if len(served) < 20 {
		t.Fatalf("only %d routes served: the route table is not being read", len(served))
	}
}

// GET /v1/openapi.yaml and /v1/openapi.json serve the same document, with
// a token like every /v1 call.
func TestOpenAPIServed(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	get := func(path string) (*http.Response, []byte) {
		req, _ := http.NewRequest(http.MethodGet, e.url+path, nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %s %s", path, resp.Status, b)
		}
		return resp, b
	}
	resp, y := get("/v1/openapi.yaml")
	if ct := resp.Header.Get("Content-Type"); ct != "application/yaml" || !bytes.Equal(y, openapiYAML) {
		t.Fatalf("GET /v1/openapi.yaml: %s, %d bytes; want application/yaml, the embedded document", ct, len(y))
	}
	resp, j := get("/v1/openapi.json")
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("GET /v1/openapi.json: content type %s", ct)
	}
	fromJSON, err := openapi3.NewLoader().LoadFromData(j)
	if err != nil {
		t.Fatalf("the JSON document does not load: %v", err)
	}
	fromYAML, _ := openapi3.NewLoader().LoadFromData(y)
	a, _ := json.Marshal(fromYAML)
	b, _ := json.Marshal(fromJSON)
	if !bytes.Equal(a, b) {
		t.Fatalf("the JSON document differs from the YAML one")
	}
	if !fromJSON.IsOpenAPI31OrLater() {
		t.Fatalf("the document is OpenAPI %s, want 3.1", fromJSON.OpenAPI)
	}
	e.token = ""
	e.want("GET", "/v1/openapi.json", "", 401)
}

// Every call the Go client (module client/) makes is an operation of the
// document: the client is run against a server that records its requests.
func TestOpenAPIGoClientRoutes(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var calls []*http.Request
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls = append(calls, r.Clone(context.Background()))
		mu.Unlock()
		writeJSON(w, http.StatusConflict, map[string]any{"error": map[string]string{"code": "conflict", "message": "recorded"}})
	}))
	t.Cleanup(srv.Close)
	c := client.New(srv.URL, client.WithToken(token))
	_, _, _ = c.Enqueue(ctx, client.Job{Type: "t", Key: "a/b"})
	_, _, _ = c.Get(ctx, "t", "a/b")
	_, _ = c.Cancel(ctx, "t", "a/b")
	_, _ = c.Replay(ctx, "t", "a/b")
	for _, err := range c.List(ctx, client.ListOptions{Type: "t"}) {
		_ = err // (the request made is what is checked, not its answer)
		break
	}
	_, _ = c.Wait(ctx, client.Ref{ID: 1, Type: "t", Key: "a/b"})
	mu.Lock()
	defer mu.Unlock()
	ops := map[string]bool{}
	for _, r := range calls {
		route, _, err := findOperation(r)
		if err != nil {
			t.Errorf("the Go client calls %s %s, which api/openapi.yaml lacks: %v", r.Method, r.URL, err)
			continue
		}
		ops[route.Method+" "+route.Path] = true
	}
	if len(ops) != 5 {
		t.Fatalf("the client's calls reached %d operations, want 5 (enqueue, get, cancel, replay, list): %v", len(ops), ops)
	}
}

package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/hipq/hipq/client"
	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/testutil"
)

// Issue 12 (the Go client): every call against the real API, with its
// typed errors.
func TestGoClient(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	c := client.New(e.url, client.WithToken(token))
	row, created, err := c.Enqueue(ctx, client.Job{Type: "t", Key: "k/1", Data: json.RawMessage(`{"n":1}`)})
	if err != nil || !created || row.ID == 0 || row.State != "initial" {
		t.Fatalf("enqueue: %+v %v %v", row, created, err)
	}
	if again, created, err := c.Enqueue(ctx, client.Job{Type: "t", Key: "k/1", Data: json.RawMessage(`{"n": 1}`)}); err != nil || created || again.ID != row.ID {
		t.Fatalf("duplicate: %+v %v %v", again, created, err)
	}
	if _, _, err := c.Enqueue(ctx, client.Job{Type: "t", Key: "k/1", Data: json.RawMessage(`{"n":2}`)}); !errors.Is(err, client.ErrConflict) {
		t.Fatalf("conflict: %v", err)
	}
	var ce *client.Error
	if _, _, err := c.Enqueue(ctx, client.Job{Type: "t", Key: "k", Priority: new(int), TimeWindows: []client.TimeWindow{{Start: "25:00", End: "01:00"}}}); !errors.Is(err, client.ErrInvalid) ||
		!errors.As(err, &ce) || ce.Code != correlator.CodeInvalidField {
		t.Fatalf("invalid: %v", err)
	}
	if _, _, err := client.New(e.url).Enqueue(ctx, client.Job{Type: "t", Key: "x"}); !errors.Is(err, client.ErrUnauthorized) {
		t.Fatalf("no token: %v", err)
	}
	got, attempts, err := c.Get(ctx, "t", "k/1")
	if err != nil || got.ID != row.ID || attempts == nil {
		t.Fatalf("get: %+v %v %v", got, attempts, err)
	}
	if _, _, err := c.Get(ctx, "t", "nope"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("get missing: %v", err)
	}

	// Wait: returns the job once it is final, here cancelled meanwhile.
	waited := make(chan client.JobRow, 1)
	go func() {
		j, err := c.Wait(ctx, row.Ref())
		if err != nil {
			t.Errorf("wait: %v", err)
		}
		waited <- j
	}()
	time.Sleep(100 * time.Millisecond) // let the wait start (it returns at once if it is already final anyway)
	if _, err := c.Cancel(ctx, "t", "k/1"); err != nil {
		t.Fatal(err)
	}
	select {
	case j := <-waited:
		if !j.Final() || j.Outcome == nil || *j.Outcome != "cancelled" {
			t.Fatalf("waited: %+v", j)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("wait did not return after the job ended")
	}
	if _, err := c.Cancel(ctx, "t", "k/1"); !errors.Is(err, client.ErrConflict) && !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("cancel of a final job: %v", err)
	}
	replayed, err := c.Replay(ctx, "t", "k/1")
	if err != nil || replayed.ID == row.ID || replayed.State != "initial" {
		t.Fatalf("replay: %+v %v", replayed, err)
	}
	// Wait honours its context.
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := c.Wait(wctx, replayed.Ref()); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait past its context: %v", err)
	}

	// List: an iterator over pages.
	for i := range 7 {
		if _, _, err := c.Enqueue(ctx, client.Job{Type: "t", Key: fmt.Sprintf("l%d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	n := 0
	for j, err := range c.List(ctx, client.ListOptions{Type: "t", PageSize: 3}) {
		if err != nil {
			t.Fatal(err)
		}
		if j.Type != "t" {
			t.Fatalf("listed %+v", j)
		}
		n++
	}
	if n != 9 { // k/1 twice (cancelled, replayed) and l0..l6
		t.Fatalf("listed %d jobs, want 9", n)
	}
}

// Issue 12: Wait rides out a restart of hipq's API in its middle: the
// connection fails, the client tries again until the API is back, and
// returns once the job ended (here while the API was down).
func TestGoClientWaitAcrossRestart(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	waiting := make(chan struct{})
	var once sync.Once
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Has("wait") {
			once.Do(func() { close(waiting) })
		}
		e.h.ServeHTTP(w, r)
	})
	serve := func(addr string) (*http.Server, string) {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: h}
		go srv.Serve(l) //nolint:errcheck // it ends with ErrServerClosed when the test closes it
		return srv, l.Addr().String()
	}
	srv, addr := serve("127.0.0.1:0")
	c := client.New("http://"+addr, client.WithToken(token))
	row, _, err := c.Enqueue(ctx, client.Job{Type: "t", Key: "restart"})
	if err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	var final client.JobRow
	go func() {
		var err error
		final, err = c.Wait(ctx, row.Ref())
		waited <- err
	}()
	select {
	case <-waiting:
	case <-time.After(20 * time.Second):
		t.Fatal("the wait never reached the API")
	}
	_ = srv.Close() // the API goes away mid-wait
	if _, err := e.st.JobCancel(ctx, "t", "restart"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		t.Fatalf("wait returned while the API was down: %v", err)
	default:
	}
	srv2, _ := serve(addr)
	defer srv2.Close()
	select {
	case err := <-waited:
		if err != nil || !final.Final() || final.ID != row.ID || *final.Outcome != "cancelled" {
			t.Fatalf("wait: %+v %v", final, err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("wait did not return after the API came back")
	}
}

// Many waits at once share the API's one listener and one look per
// notice: each returns when its own job ends, not when another's does.
func TestGoClientManyWaits(t *testing.T) {
	t.Parallel()
	e := newAPI(t, token)
	c := client.New(e.url, client.WithToken(token))
	const n = 20
	refs := make([]client.Ref, n)
	for i := range refs {
		row, _, err := c.Enqueue(ctx, client.Job{Type: "t", Key: fmt.Sprintf("w%d", i)})
		if err != nil {
			t.Fatal(err)
		}
		refs[i] = row.Ref()
	}
	var returned sync.Map
	var wg sync.WaitGroup
	for i, ref := range refs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			j, err := c.Wait(ctx, ref)
			if err != nil || !j.Final() {
				t.Errorf("wait %d: %+v %v", i, j, err)
			}
			returned.Store(i, true)
		}()
	}
	// The even jobs end; the odd ones keep waiting.
	for i := 0; i < n; i += 2 {
		if _, err := e.st.JobCancel(ctx, "t", fmt.Sprintf("w%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < n; i += 2 {
		testutil.Eventually(t, 20*time.Second, func() bool { _, ok := returned.Load(i); return ok },
			"wait %d to return after its job ended", i)
	}
	for i := 1; i < n; i += 2 {
		if _, ok := returned.Load(i); ok {
			t.Fatalf("wait %d returned while its job runs on", i)
		}
	}
	for i := 1; i < n; i += 2 {
		if _, err := e.st.JobCancel(ctx, "t", fmt.Sprintf("w%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	if v, _ := e.m.Value("hipq_api_waits_total", map[string]string{"result": "final"}); v != n {
		t.Fatalf("hipq_api_waits_total{result=final} = %v, want %d", v, n)
	}
}

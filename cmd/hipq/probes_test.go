package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/hipq/hipq/internal/testutil"
)

// An instance without an api section serves /metrics, /healthz and
// /readyz on metrics.listen, whatever roles it runs: a dispatcher-only
// deployment can be scraped and probed.
func TestProbesWithoutAPI(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	cfg := e.config(e2eConfig + fmt.Sprintf("metrics: {listen: %q}\n", addr))
	if cfg.API != nil {
		t.Fatal("the config has an api section")
	}
	e.start(cfg, "dispatcher")
	get := func(path string) (int, []byte) {
		t.Helper()
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	if code, body := get("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz: %d %s", code, body)
	}
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		code, body := get("/readyz")
		var out struct {
			Ready  bool
			Checks map[string]string
		}
		_ = json.Unmarshal(body, &out)
		return code == http.StatusOK && out.Ready && out.Checks["postgres"] == "ok" && out.Checks["kafka"] == "ok", string(body)
	}, "/readyz")
	code, body := get("/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d %s", code, body)
	}
	if _, ok := parseMetrics(t, string(body))[`hipq_jobs{queue="default",state="initial"}`]; !ok {
		t.Fatalf("/metrics has no hipq_jobs series:\n%s", body)
	}
}

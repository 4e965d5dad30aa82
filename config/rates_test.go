package config

import (
	"strings"
	"testing"
	"time"
)

// Rates of queues and types reach the queue's throttle, named by place;
// a bad one is reported with its path.
func TestRatesConfig(t *testing.T) {
	base := strings.ReplaceAll(minimal, "${DB_URL}", "postgres://x") + `
queues:
  - {name: shipping, rates: [{limit: 600, period: 1m}, {limit: 10, period: 1s, by: {json: /tenant}}]}
job_types:
  - {name: ship, queue: shipping, transport: {kafka: {topic: r}}, rates: [{limit: 50, period: 1s}]}
`
	cfg, err := Parse(base, env(nil))
	if err != nil {
		t.Fatal(err)
	}
	rs := cfg.Throttles()["shipping"].Rates
	if len(rs) != 3 || rs[0].Key != "q:shipping#0" || rs[0].Period != time.Minute || rs[1].Pointer != "/tenant" ||
		len(rs[1].Path) != 1 || rs[1].Path[0] != "tenant" || rs[2].Key != "t:ship#0" || rs[2].Type != "ship" || rs[2].Limit != 50 {
		t.Errorf("rates: %+v", rs)
	}
	if !cfg.Throttles()["shipping"].Bounded() {
		t.Error("a queue with rates is not claimed under its lock")
	}
	for bad, want := range map[string]string{
		"{limit: 0, period: 1s}":                     "queues[0].rates[0]: limit 0",
		"{limit: 5, period: 0s}":                     "queues[0].rates[0]: period",
		"{limit: 5, period: 1s, by: {json: tenant}}": "queues[0].rates[0]: by",
		"{limit: 5, period: 1s, by: {header: x}}":    "queues[0].rates[0]: by",
	} {
		text := strings.Replace(base, "{limit: 600, period: 1m}", bad, 1)
		if _, err := Parse(text, env(nil)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", bad, err, want)
		}
	}
}

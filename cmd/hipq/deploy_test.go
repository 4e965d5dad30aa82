package main

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"gopkg.in/yaml.v3"

	"github.com/hipq/hipq/internal/testutil"
)

// The Prometheus rules in deploy/ (docs/operations.md, "Alerts and
// dashboard").
var (
	rulesFile     = filepath.Join("..", "..", "deploy", "prometheus", "hipq-rules.yaml")
	rulesTestFile = filepath.Join("..", "..", "deploy", "prometheus", "hipq-rules.test.yaml")
)

type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Record      string            `yaml:"record"`
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func readRules(t *testing.T) ruleFile {
	t.Helper()
	b, err := os.ReadFile(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	var rf ruleFile
	if err := yaml.Unmarshal(b, &rf); err != nil {
		t.Fatalf("%s: %v", rulesFile, err)
	}
	return rf
}

// promqlKeywords are the identifiers of PromQL that are not metric names
// though no "(" may follow them: keywords, and the aggregations, which may
// be followed by "by (…)" or "without (…)" (functions are always
// followed by "(").
var promqlKeywords = []string{"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
	"group_left", "group_right", "inf", "nan", "atan2",
	"sum", "avg", "count", "min", "max", "group", "stddev", "stdvar", "topk", "bottomk", "count_values", "quantile",
	"limitk", "limit_ratio"}

// metricNames returns the metric names a PromQL expression reads: the
// identifiers left once strings, label matchers ({…}), ranges ([…]),
// numbers and durations, Grafana variables ($name), functions and
// aggregations (an identifier before "("), keywords and the label lists
// after by, without, on, ignoring, group_left and group_right are set
// aside.
func metricNames(expr string) []string {
	var names []string
	isIdent := func(c byte, first bool) bool {
		return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || !first && c >= '0' && c <= '9'
	}
	skipString := func(i int) int { // i at the opening quote; returns the index after the closing one
		q := expr[i]
		for i++; i < len(expr) && expr[i] != q; i++ {
			if expr[i] == '\\' && q != '`' {
				i++
			}
		}
		return i + 1
	}
	skipTo := func(i int, end byte) int { // past the next end outside strings
		for i < len(expr) && expr[i] != end {
			if c := expr[i]; c == '"' || c == '\'' || c == '`' {
				i = skipString(i)
				continue
			}
			i++
		}
		return i + 1
	}
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			i = skipString(i)
		case c == '{':
			i = skipTo(i+1, '}')
		case c == '[':
			i = skipTo(i+1, ']')
		case c == '#':
			i = skipTo(i+1, '\n')
		case c == '$':
			i++
			if i < len(expr) && expr[i] == '{' {
				i = skipTo(i+1, '}')
				continue
			}
			for i < len(expr) && isIdent(expr[i], false) {
				i++
			}
		case c >= '0' && c <= '9' || c == '.':
			for i < len(expr) && (isIdent(expr[i], false) || expr[i] == '.') {
				i++
			}
		case isIdent(c, true):
			j := i
			for j < len(expr) && isIdent(expr[j], false) {
				j++
			}
			word := expr[i:j]
			k := j
			for k < len(expr) && (expr[k] == ' ' || expr[k] == '\t' || expr[k] == '\n') {
				k++
			}
			paren := k < len(expr) && expr[k] == '('
			switch {
			case slices.Contains([]string{"by", "without", "on", "ignoring", "group_left", "group_right"}, word):
				if paren { // a list of labels
					j = skipTo(k+1, ')')
				}
			case paren, slices.Contains(promqlKeywords, word):
			default:
				names = append(names, word)
			}
			i = j
		default:
			i++
		}
	}
	return names
}

func TestMetricNames(t *testing.T) {
	for expr, want := range map[string][]string{
		`sum by (queue, le) (rate(hipq_round_trip_seconds_bucket{job=~"$job",queue!="a}b"}[$__rate_interval]))`: {"hipq_round_trip_seconds_bucket"},
		`a:b:c > 0 unless on (queue) sum without(x) (increase(m_total[5m] offset 1h)) > bool 1e3`:               {"a:b:c", "m_total"},
		`absent(x) or vector(0) * on(i) group_left(l) y{l='}'} and histogram_quantile(0.5, z)`:                  {"x", "y", "z"},
		`label_replace(up, "dst", "$1", "src", "(.*)")`:                                                         {"up"},
	} {
		if got := metricNames(expr); !slices.Equal(got, want) {
			t.Errorf("metricNames(%s) = %q, want %q", expr, got, want)
		}
	}
}

// Every alert says what it means and what to do (summary, description,
// runbook), has a severity, and has a unit test in which it fires.
func TestAlertsHaveRunbooksAndTests(t *testing.T) {
	rf := readRules(t)
	b, err := os.ReadFile(rulesTestFile)
	if err != nil {
		t.Fatal(err)
	}
	var tf struct {
		Tests []struct {
			Name          string `yaml:"name"`
			AlertRuleTest []struct {
				Alertname string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	if err := yaml.Unmarshal(b, &tf); err != nil {
		t.Fatalf("%s: %v", rulesTestFile, err)
	}
	fires := map[string]bool{}
	for _, tc := range tf.Tests {
		for _, a := range tc.AlertRuleTest {
			fires[a.Alertname] = fires[a.Alertname] || len(a.ExpAlerts) > 0
		}
	}
	alerts := 0
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			alerts++
			for _, k := range []string{"summary", "description", "runbook"} {
				if strings.TrimSpace(r.Annotations[k]) == "" {
					t.Errorf("alert %s: no %s annotation", r.Alert, k)
				}
			}
			if r.Labels["severity"] == "" {
				t.Errorf("alert %s: no severity label", r.Alert)
			}
			if !fires[r.Alert] {
				t.Errorf("alert %s: no test in %s where it fires", r.Alert, rulesTestFile)
			}
		}
	}
	if alerts == 0 {
		t.Fatalf("%s: no alerts", rulesFile)
	}
}

// promtool checks the rules and runs their unit tests.
func TestPrometheusRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not found on PATH: the rules are not checked (Debian: apt-get install prometheus)")
	}
	run := func(dir string, args ...string) {
		t.Helper()
		cmd := exec.Command(promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	run(filepath.Dir(rulesFile), "check", "rules", filepath.Base(rulesFile))
	run(filepath.Dir(rulesTestFile), "test", "rules", filepath.Base(rulesTestFile))

}

const deployConfig = `
name: deploy
database: {url: "{{APPDB}}", migrate: false}
kafka: {brokers: ["{{BROKERS}}"], session_timeout: 6s}
intake: {topics: ["{{T:jobs}}"], dead_letter_topic: "{{T:jobs.dlq}}"}
responses: {topics: [{topic: "{{T:replies}}"}], dead_letter_topic: "{{T:replies.dlq}}"}
dispatch: {interval: 100ms, batch_size: 50, grace: 1s}
sweeper: {schedule: "@every 1s"}
job_types:
  - name: e2e
    transport: {kafka: {topic: "{{T:requests}}"}}
    reply_topic: "{{T:replies}}"
    timeout: 10m
`

// liveFamilies reads the metric families a running hipq serves at url
// (its # TYPE lines): name to type.
func liveFamilies(t *testing.T, url string) map[string]string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	fams := map[string]string{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			fams[f[2]] = f[3]
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return fams
}

// exported says whether a series name belongs to one of fams: the family
// itself, or a histogram's (or summary's) _bucket, _sum or _count.
func exported(fams map[string]string, name string) bool {
	if _, ok := fams[name]; ok {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if !ok {
			continue
		}
		if typ := fams[base]; typ == "histogram" || typ == "summary" && suffix != "_bucket" {
			return true
		}
	}
	return false
}

// Every metric name the alerts and the recording rules read is
// one hipq exports, as a running instance's /metrics shows it; every
// recorded name they read is recorded by the rules. A vector family shows
// only once it has a series, so the instance runs a job to its reply, a
// sweep, and a stall (INSERT on hipq_job revoked, two intake records on
// one partition refused alike) first.
func TestDeployUsesExportedMetrics(t *testing.T) {
	t.Parallel()
	rf := readRules(t)
	recorded := map[string]bool{}
	used := map[string][]string{} // name: where
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			if r.Record != "" {
				recorded[r.Record] = true
			}
			where := "rules " + cmp.Or(r.Alert, r.Record)
			for _, n := range metricNames(r.Expr) {
				used[n] = append(used[n], where)
			}
		}
	}
	var live []string
	for n, where := range used {
		if strings.Contains(n, ":") {
			if !recorded[n] {
				t.Errorf("%s is read (%s) but no rule records it", n, strings.Join(where, "; "))
			}
			continue
		}
		live = append(live, n)
	}
	slices.Sort(live)

	e := newEnv(t, e2eTopics...)
	role, appURL := e.appRole()
	text, apiURL := withAPI(t, strings.Replace(deployConfig, "{{APPDB}}", appURL, 1), "")
	e.start(e.config(text))
	waitAPI(t, apiURL)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.respond(ctx, "requests", "replies", func(string, int) (string, bool) { return "succeeded", true })
	e.produce("jobs", jobReq("one"))
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		fams := liveFamilies(t, apiURL+"/metrics")
		return exported(fams, "hipq_round_trip_seconds") && exported(fams, "hipq_sweeper_actions_total"),
			"round trips and sweeps not on /metrics yet"
	}, "a job's round trip and a sweep")

	if _, err := e.pool().Exec(ctx, fmt.Sprintf(`REVOKE INSERT ON hipq_job FROM %s`, pgx.Identifier{role}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	e.produceTo(
		&kgo.Record{Topic: e.kafka.Topic("jobs"), Partition: 0, Value: []byte(jobReq("refused-0"))},
		&kgo.Record{Topic: e.kafka.Topic("jobs"), Partition: 0, Value: []byte(jobReq("refused-1"))})
	testutil.Eventually(t, 60*time.Second, func() bool {
		return exported(liveFamilies(t, apiURL+"/metrics"), "hipq_consumer_stalled")
	}, "the intake stalled")

	fams := liveFamilies(t, apiURL+"/metrics")
	for _, n := range live {
		if !exported(fams, n) {
			t.Errorf("%s is read (%s) but hipq's /metrics has no such family", n, strings.Join(used[n], "; "))
		}
	}
	t.Logf("%d metric names checked against /metrics: %s", len(live), strings.Join(live, ", "))
}

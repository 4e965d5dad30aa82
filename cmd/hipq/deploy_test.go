package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"gopkg.in/yaml.v3"

	"github.com/hipq/hipq/internal/testutil"
)

// The Prometheus rules and the Grafana board in deploy/ (docs/operations.md,
// "Alerts and dashboard").
var (
	rulesFile      = filepath.Join("..", "..", "deploy", "prometheus", "hipq-rules.yaml")
	rulesTestFile  = filepath.Join("..", "..", "deploy", "prometheus", "hipq-rules.test.yaml")
	dashboardFile  = filepath.Join("..", "..", "deploy", "grafana", "hipq.json")
	grafanaVarRef  = regexp.MustCompile(`\$\{?(\w+)\}?`)
	labelValuesFun = regexp.MustCompile(`^label_values\((.*)\)$`)
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

// dashboardQueries returns the board's PromQL: every target's expr, and
// the selector of every label_values variable query, keyed by where it is.
func dashboardQueries(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var board struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Query struct {
					Query string `json:"query"`
				} `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &board); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	out := map[string]string{}
	for _, p := range board.Panels {
		for i, tg := range p.Targets {
			out[fmt.Sprintf("panel %q target %d", p.Title, i)] = tg.Expr
		}
	}
	for _, v := range board.Templating.List {
		q := v.Query.Query
		m := labelValuesFun.FindStringSubmatch(q)
		if m == nil {
			t.Fatalf("%s: variable %s: query %q is not label_values(selector, label)", dashboardFile, v.Name, q)
		}
		i := strings.LastIndexByte(m[1], ',') // the label is the last argument
		if i < 0 {
			t.Fatalf("%s: variable %s: query %q names no metric", dashboardFile, v.Name, q)
		}
		out["variable "+v.Name] = strings.TrimSpace(m[1][:i])
	}
	if len(out) == 0 {
		t.Fatalf("%s: no queries", dashboardFile)
	}
	return out
}

// The board asks for its data source at import (the DS_PROMETHEUS input)
// and every panel and query reads from it.
func TestGrafanaBoardDataSource(t *testing.T) {
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	type ds struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	}
	var board struct {
		Inputs []struct {
			Name     string `json:"name"`
			Type     string `json:"type"`
			PluginID string `json:"pluginId"`
		} `json:"__inputs"`
		Panels []struct {
			Title      string `json:"title"`
			Type       string `json:"type"`
			Datasource *ds    `json:"datasource"`
			Targets    []struct {
				Datasource *ds `json:"datasource"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Datasource *ds    `json:"datasource"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &board); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if len(board.Inputs) != 1 || board.Inputs[0].Name != "DS_PROMETHEUS" || board.Inputs[0].Type != "datasource" || board.Inputs[0].PluginID != "prometheus" {
		t.Errorf("__inputs = %+v, want the one Prometheus data source DS_PROMETHEUS", board.Inputs)
	}
	want := ds{Type: "prometheus", UID: "${DS_PROMETHEUS}"}
	check := func(where string, d *ds) {
		if d == nil || *d != want {
			t.Errorf("%s: data source %+v, want %+v", where, d, want)
		}
	}
	for _, p := range board.Panels {
		if p.Type == "row" {
			continue
		}
		check(fmt.Sprintf("panel %q", p.Title), p.Datasource)
		for i, tg := range p.Targets {
			check(fmt.Sprintf("panel %q target %d", p.Title, i), tg.Datasource)
		}
	}
	for _, v := range board.Templating.List {
		check("variable "+v.Name, v.Datasource)
	}
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

// promtool checks the rules and runs their unit tests, and checks the
// board's queries parse (as recording rules of a throwaway file, with the
// board's variables filled in).
func TestPrometheusRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not found on PATH: the rules and the board's queries are not checked (Debian: apt-get install prometheus)")
	}
	run := func(dir string, args ...string) bool {
		t.Helper()
		cmd := exec.Command(promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return err == nil
	}
	run(filepath.Dir(rulesFile), "check", "rules", filepath.Base(rulesFile))
	run(filepath.Dir(rulesTestFile), "test", "rules", filepath.Base(rulesTestFile))

	type rule struct {
		Record string `yaml:"record"`
		Expr   string `yaml:"expr"`
	}
	type group struct {
		Name  string `yaml:"name"`
		Rules []rule `yaml:"rules"`
	}
	board := group{Name: "board"}
	var wheres []string
	queries := dashboardQueries(t)
	for _, where := range slices.Sorted(maps.Keys(queries)) {
		expr := grafanaVarRef.ReplaceAllStringFunc(queries[where], func(v string) string {
			if strings.Contains(v, "__rate_interval") || strings.Contains(v, "__interval") {
				return "5m"
			}
			return ".*" // the board's own variables are all in regular expressions
		})
		board.Rules = append(board.Rules, rule{Record: fmt.Sprintf("board:query_%d", len(board.Rules)), Expr: expr})
		wheres = append(wheres, where)
	}
	b, err := yaml.Marshal(map[string][]group{"groups": {board}})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "board-queries.yaml"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	if !run(dir, "check", "rules", "board-queries.yaml") {
		for i, where := range wheres {
			t.Logf("board:query_%d is %s", i, where)
		}
	}
}

const deployConfig = `
name: deploy
database: {url: "{{APPDB}}", migrate: false}
kafka: {brokers: ["{{BROKERS}}"], session_timeout: 6s}
intake: {topics: ["{{T:jobs}}"], dead_letter_topic: "{{T:jobs.dlq}}"}
responses: {topics: [{topic: "{{T:replies}}"}], dead_letter_topic: "{{T:replies.dlq}}"}
dispatch: {interval: 100ms, batch_size: 50, grace: 1s}
sweeper: {schedule: "@every 1s"}
events: {topic: "{{T:events}}"}
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

// Every metric name the alerts, the recording rules and the board read is
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
	for where, q := range dashboardQueries(t) {
		for _, n := range metricNames(q) {
			used[n] = append(used[n], "board "+where)
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

	e := newEnv(t, append(slices.Clone(e2eTopics), "events")...)
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
		return exported(fams, "hipq_round_trip_seconds") && exported(fams, "hipq_sweeper_actions_total") &&
				exported(fams, "hipq_events_total") && exported(fams, "hipq_events_pending"),
			"round trips, sweeps and events not on /metrics yet"
	}, "a job's round trip, its event and a sweep")

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

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/internal/testutil"
)

// periodicConfig: one schedule every 2 s whose key is its tick's Unix time.
const periodicConfig = `
name: periodic
database: {url: "{{DB}}"}
kafka: {brokers: ["{{BROKERS}}"]}
responses: {topics: [{topic: "{{T:replies}}"}]}
sweeper: {schedule: "@every 1h"}
queues: [{name: default}]
job_types:
  - {name: tick, transport: {kafka: {topic: "{{T:requests}}"}}, timeout: 30s}
schedules:
  - name: every2
    cron: "@every 2s"
    job_type: tick
    job_key: 't-{{.Time.Unix}}'
    job_data: {from: schedule}
    catch_up: CATCHUP
`

// startStoppable runs an app until stop is called (or the test ends).
func (e *env) startStoppable(cfg *config.Config, roles ...string) (*app, func()) {
	e.t.Helper()
	log := zaptest.NewLogger(e.t, zaptest.Level(zap.WarnLevel))
	a, err := newApp(context.Background(), cfg, log, appOptions{roles: roles, metadataMinAge: 100 * time.Millisecond})
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.run(ctx) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				e.t.Errorf("app: %v", err)
			}
		case <-time.After(30 * time.Second):
			e.t.Error("app did not stop within 30s")
		}
		a.close()
	}
	e.t.Cleanup(stop)
	return a, stop
}

// tickKeys returns the ticks (Unix seconds) of the schedule's jobs, sorted.
func (e *env) tickKeys(a *app) []int64 {
	e.t.Helper()
	rows, err := e.pool().Query(context.Background(), "SELECT job_key FROM hipq_job WHERE job_type = 'tick'")
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			e.t.Fatal(err)
		}
		n, err := strconv.ParseInt(strings.TrimPrefix(k, "t-"), 10, 64)
		if err != nil {
			e.t.Fatalf("key %q", k)
		}
		out = append(out, n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func (e *env) lastFire(a *app) time.Time {
	e.t.Helper()
	var t time.Time
	if err := e.pool().QueryRow(context.Background(), "SELECT last_fire FROM hipq_schedule WHERE name = 'every2'").Scan(&t); err != nil {
		e.t.Fatal(err)
	}
	return t
}

func (e *env) dbNow(a *app) time.Time {
	e.t.Helper()
	var t time.Time
	if err := e.pool().QueryRow(context.Background(), "SELECT now()").Scan(&t); err != nil {
		e.t.Fatal(err)
	}
	return t
}

// Three instances run one schedule for 10 s: each tick makes one job, on
// one instance; no instance even tries a tick another fired (no duplicate).
func TestPeriodicOncePerTickAcrossInstances(t *testing.T) {
	e := newEnv(t, "replies", "requests")
	text := strings.Replace(periodicConfig, "CATCHUP", "latest", 1)
	var apps []*app
	var stops []func()
	for range 3 {
		a, stop := e.startStoppable(e.config(text), "sweeper")
		apps, stops = append(apps, a), append(stops, stop)
	}
	time.Sleep(10 * time.Second) // the acceptance's run length, not a wait for a condition
	for _, stop := range stops {
		stop()
	}
	ticks := e.tickKeys(apps[0])
	if len(ticks) < 4 || len(ticks) > 6 {
		t.Errorf("%d jobs in 10 s of @every 2s, want 5 ± 1: %v", len(ticks), ticks)
	}
	for i := 1; i < len(ticks); i++ {
		if ticks[i]-ticks[i-1] != 2 {
			t.Errorf("ticks %v are not 2 s apart", ticks)
		}
	}
	var enqueued, duplicate float64
	for _, a := range apps {
		m := scrape(t, a.metrics.Handler())
		enqueued += m[`hipq_schedule_fires_total{result="enqueued",schedule="every2"}`]
		duplicate += m[`hipq_schedule_fires_total{result="duplicate",schedule="every2"}`]
	}
	if int(enqueued) != len(ticks) || duplicate != 0 {
		t.Errorf("instances enqueued %v and met %v duplicates for %d jobs", enqueued, duplicate, len(ticks))
	}
}

// Every instance down for three ticks, then one up: latest fires the
// latest missed tick once, none fires none, all fires the three.
func TestPeriodicCatchUp(t *testing.T) {
	for policy, want := range map[string]int{"latest": 1, "none": 0, "all": 3} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, "replies", "requests")
			cfg := e.config(strings.Replace(periodicConfig, "CATCHUP", policy, 1))
			a, stop := e.startStoppable(cfg, "sweeper")
			testutil.Eventually(t, 10*time.Second, func() (bool, string) {
				return len(e.tickKeys(a)) > 0, ""
			}, "a first tick")
			stop()
			last := e.lastFire(a)
			// Wait out three ticks; start again well clear of a tick, so
			// the fourth falls due after the start and is on time.
			for {
				since := e.dbNow(a).Sub(last)
				if since > 7200*time.Millisecond && since < 7700*time.Millisecond {
					break
				}
				if since > 7700*time.Millisecond {
					t.Fatalf("missed the restart moment: %v after the last fire", since)
				}
				time.Sleep(20 * time.Millisecond)
			}
			b, stop := e.startStoppable(cfg, "sweeper")
			testutil.Eventually(t, 10*time.Second, func() (bool, string) {
				l := e.lastFire(b)
				return !l.Before(last.Add(6 * time.Second)), l.String()
			}, "the catch-up look")
			stop()
			var missed []int64
			for _, k := range e.tickKeys(b) {
				if k > last.Unix() && k <= last.Add(6*time.Second).Unix() {
					missed = append(missed, k)
				}
			}
			if len(missed) != want {
				t.Errorf("catch_up %s fired %v of the three missed ticks after %v, want %d", policy, missed, last.Unix(), want)
			}
			if policy == "latest" && len(missed) == 1 && missed[0] != last.Add(6*time.Second).Unix() {
				t.Errorf("latest fired %v, not the latest tick", missed)
			}
		})
	}
}

// A tick whose job is already final does not fire again after a restart:
// the key's unique index would let it in (it covers non-final jobs), the
// schedule's last fire time does not.
func TestPeriodicFinalTickDoesNotRefire(t *testing.T) {
	e := newEnv(t, "replies", "requests")
	cfg := e.config(strings.Replace(periodicConfig, "CATCHUP", "all", 1))
	a, stop := e.startStoppable(cfg, "sweeper")
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		return len(e.tickKeys(a)) > 0, ""
	}, "a first tick")
	stop()
	first := e.tickKeys(a)[0]
	if _, err := e.pool().Exec(context.Background(),
		"UPDATE hipq_job SET state = 'final', outcome = 'cancelled', error = 'cancelled' WHERE job_key = $1", fmt.Sprintf("t-%d", first)); err != nil {
		t.Fatal(err)
	}
	b, stop := e.startStoppable(cfg, "sweeper")
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		return e.lastFire(b).Unix() > first+2, e.lastFire(b).String()
	}, "the next tick")
	stop()
	n := 0
	for _, k := range e.tickKeys(b) {
		if k == first {
			n++
		}
	}
	if n != 1 {
		t.Errorf("tick %d has %d jobs after a restart, want 1", first, n)
	}
}

// The API lists schedules, pauses (ticks pass without jobs), resumes
// (without backfilling) and triggers; the CLI lists over the API.
func TestPeriodicAPI(t *testing.T) {
	e := newEnv(t, "replies", "requests")
	text, url := withAPI(t, strings.Replace(periodicConfig, "CATCHUP", "all", 1), "")
	a, _ := e.startStoppable(e.config(text), "sweeper", "api")
	waitAPI(t, url)
	post := func(path string, want int) map[string]any {
		t.Helper()
		resp, err := http.Post(url+path, "application/json", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&out)
		if resp.StatusCode != want {
			t.Fatalf("POST %s: %d %v, want %d", path, resp.StatusCode, out, want)
		}
		return out
	}
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		return len(e.tickKeys(a)) > 0, ""
	}, "a first tick")
	post("/v1/schedules/every2/pause", http.StatusOK)
	paused := len(e.tickKeys(a))
	pausedAt := e.dbNow(a)
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		return e.dbNow(a).Sub(pausedAt) > 5*time.Second, ""
	}, "ticks passing while paused")
	if n := len(e.tickKeys(a)); n != paused {
		t.Errorf("%d jobs while paused, had %d", n, paused)
	}
	got := post("/v1/schedules/every2/trigger", http.StatusCreated)
	if !strings.HasPrefix(fmt.Sprint(got["job_key"]), "t-") || len(e.tickKeys(a)) != paused+1 {
		t.Errorf("trigger: %v, %d jobs", got, len(e.tickKeys(a)))
	}
	paused++
	var out strings.Builder
	if err := cmdSchedules([]string{"list", "--server", url}, &out); err != nil || !strings.Contains(out.String(), "every2") ||
		!strings.Contains(out.String(), "paused") {
		t.Errorf("schedules list: %v\n%s", err, out.String())
	}
	post("/v1/schedules/every2/resume", http.StatusOK)
	testutil.Eventually(t, 10*time.Second, func() (bool, string) {
		return len(e.tickKeys(a)) > paused, ""
	}, "a tick after resuming")
	for _, k := range e.tickKeys(a) {
		if k > pausedAt.Unix()+1 && k < pausedAt.Unix()+5 {
			t.Errorf("tick %d of the paused time fired after resuming", k)
		}
	}
	post("/v1/schedules/nope/trigger", http.StatusNotFound)
	resp, err := http.Get(url + "/v1/schedules")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Schedules []struct {
			Name     string     `json:"name"`
			NextFire *time.Time `json:"next_fire"`
		}
	}
	_ = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if len(list.Schedules) != 1 || list.Schedules[0].NextFire == nil {
		t.Errorf("GET /v1/schedules: %+v", list)
	}
	if m := scrape(t, a.metrics.Handler()); m[`hipq_schedule_fires_total{result="enqueued",schedule="every2"}`] < 2 {
		t.Errorf("fires metric: %v", m[`hipq_schedule_fires_total{result="enqueued",schedule="every2"}`])
	}
}

// schedules next needs only the config; a key template that cannot render
// is a config error naming the field.
func TestSchedulesNextCLI(t *testing.T) {
	dir := t.TempDir()
	text := `
database: {url: "postgres://x@localhost/x"}
kafka: {brokers: ["localhost:9092"]}
queues: [{name: default}]
job_types: [{name: report.daily, transport: {kafka: {topic: reports}}}]
schedules:
  - {name: daily-report, cron: "30 2 * * *", tz: Europe/Berlin, job_type: report.daily, job_key: 'daily-{{.Time.Format "2006-01-02"}}'}
`
	path := dir + "/hipq.yaml"
	writeFile(t, path, text)
	for from, want := range map[string]string{
		"2026-03-28T12:00:00+01:00": "2026-03-29T03:00:00+02:00\n2026-03-30T02:30:00+02:00\n",
		"2026-10-24T12:00:00+02:00": "2026-10-25T02:30:00+02:00\n2026-10-26T02:30:00+01:00\n",
	} {
		var out strings.Builder
		if err := cmdSchedules([]string{"next", "daily-report", "--config", path, "--from", from, "--count", "2"}, &out); err != nil || out.String() != want {
			t.Errorf("from %s: %v\n%s want\n%s", from, err, out.String(), want)
		}
	}
	writeFile(t, path, strings.Replace(text, `{{.Time.Format "2006-01-02"}}`, `{{.When}}`, 1))
	err := cmdSchedules([]string{"next", "daily-report", "--config", path}, &strings.Builder{})
	if err == nil || !strings.Contains(err.Error(), "schedules[0].job_key") {
		t.Errorf("a key template that fails: %v", err)
	}
}

func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// pool is a connection pool of the test's database, apart from any app's
// (an app closes its own when it stops).
func (e *env) pool() *pgxpool.Pool {
	e.t.Helper()
	if e.db == nil {
		p, err := pgxpool.New(context.Background(), e.dbURL)
		if err != nil {
			e.t.Fatal(err)
		}
		e.db = p
		e.t.Cleanup(p.Close)
	}
	return e.db
}

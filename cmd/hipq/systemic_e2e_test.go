package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/testutil"
)

const systemicConfig = `
name: sys
database: {url: "{{APPDB}}", migrate: false}
kafka: {brokers: ["{{BROKERS}}"], session_timeout: 6s}
intake: {topics: ["{{T:jobs}}"], dead_letter_topic: "{{T:jobs.dlq}}", outbox: true}
responses: {topics: [{topic: "{{T:replies}}"}], dead_letter_topic: "{{T:replies.dlq}}", early_ttl: 10m}
dispatch: {interval: 100ms, batch_size: 50, grace: 1s}
sweeper: {schedule: "@every 1s"}
job_types:
  - name: e2e
    transport: {kafka: {topic: "{{T:requests}}"}}
    reply_topic: "{{T:replies}}"
    timeout: 10m
`

// appRole makes a role that is not a superuser, with the privileges hipq
// needs on the test's database (tables made by another role, as when an
// operator migrates apart), and returns the database URL that connects as
// it. The role is dropped when the test ends, after the app stopped.
func (e *env) appRole() (role, url string) {
	e.t.Helper()
	cfg, err := pgx.ParseConfig(e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	role = cfg.Database + "_app"
	id := pgx.Identifier{role}.Sanitize()
	if _, err := e.pool().Exec(context.Background(), fmt.Sprintf(`
		CREATE ROLE %[1]s LOGIN PASSWORD 'app-password';
		GRANT USAGE ON SCHEMA public TO %[1]s;
		GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO %[1]s;
		GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO %[1]s;`, id)); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		_, _ = e.pool().Exec(context.Background(), fmt.Sprintf(`DROP OWNED BY %[1]s; DROP ROLE %[1]s`, id))
	})
	return role, fmt.Sprintf("host=%s port=%d user=%s password=app-password dbname=%s sslmode=disable", cfg.Host, cfg.Port, role, cfg.Database)
}

func (e *env) adminScalar(q string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.pool().QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// Issue 30.5: INSERT and UPDATE on hipq_job revoked from the role hipq
// connects as, while intake records, replies, outbox rows and callbacks
// flow. No error of theirs: nothing is dead-lettered and no offset moves;
// each consumer stalls (hipq_consumer_stalled 1 per group, named by
// /readyz), callbacks answer 503. Once the privileges are back, every
// record becomes its job or effect exactly once, by itself.
func TestRevokedPrivilegeStallsEveryConsumer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, e2eTopics...)
	role, appURL := e.appRole()
	text, apiURL := withAPI(t, strings.Replace(systemicConfig, "{{APPDB}}", appURL, 1), "")
	a := e.start(e.config(text))
	waitAPI(t, apiURL)
	ctx := context.Background()
	jobs, replies := e.kafka.Topic("jobs"), e.kafka.Topic("replies")

	// Six jobs sent and waiting for replies.
	var pre []*kgo.Record
	for i := range 6 {
		pre = append(pre, &kgo.Record{Topic: jobs, Partition: int32(i % 2), Value: []byte(jobReq(fmt.Sprintf("pre-%d", i)))})
	}
	e.produceTo(pre...)
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.adminScalar(`SELECT count(*) FROM hipq_job WHERE state = 'running'`)
		return n == 6, fmt.Sprintf("%d of 6 running", n)
	}, "the first jobs sent")
	ids := map[string]int64{}
	for i := range 6 {
		j, err := a.st.JobGet(ctx, "e2e", fmt.Sprintf("pre-%d", i))
		if err != nil {
			t.Fatal(err)
		}
		ids[j.JobKey] = j.ID
	}

	if _, err := e.pool().Exec(ctx, fmt.Sprintf(`REVOKE INSERT, UPDATE ON hipq_job FROM %s`, pgx.Identifier{role}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	// Intake records and replies on both partitions, outbox rows.
	reply := func(key string, p int32) *kgo.Record {
		return &kgo.Record{Topic: replies, Partition: p, Value: []byte(`{"status": "succeeded"}`), Headers: []kgo.RecordHeader{
			{Key: correlator.HeaderJobType, Value: []byte("e2e")}, {Key: correlator.HeaderJobKey, Value: []byte(key)},
			{Key: correlator.HeaderAttempt, Value: []byte("1")}}}
	}
	e.produceTo(
		&kgo.Record{Topic: jobs, Partition: 0, Value: []byte(jobReq("mid-0"))},
		&kgo.Record{Topic: jobs, Partition: 0, Value: []byte(jobReq("mid-1"))},
		&kgo.Record{Topic: jobs, Partition: 1, Value: []byte(jobReq("mid-2"))},
		&kgo.Record{Topic: jobs, Partition: 1, Value: []byte(jobReq("mid-3"))},
		reply("pre-0", 0), reply("pre-1", 0), reply("pre-2", 1), reply("pre-3", 1),
	)
	if _, err := e.pool().Exec(ctx, `INSERT INTO hipq_intake (value) VALUES ($1), ($2), ($3)`,
		jobReq("box-0"), jobReq("box-1"), jobReq("box-2")); err != nil {
		t.Fatal(err)
	}
	callback := func(key string) (int, string) {
		t.Helper()
		u := correlator.CallbackURL(apiURL, []byte(strings.Repeat("S", 32)), ids[key], "e2e", key, 1)
		resp, err := http.Post(u, "application/json", strings.NewReader(`{"status": "succeeded"}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, key := range []string{"pre-4", "pre-5"} {
		if code, body := callback(key); code != http.StatusServiceUnavailable || !strings.Contains(body, "42501") {
			t.Fatalf("callback %s while refused: %d %s, want 503 naming SQLSTATE 42501", key, code, body)
		}
	}
	groups := []string{"sys-intake", "sys-responses", "outbox"}
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		m := scrape(t, a.metrics.Handler())
		var got []string
		for _, g := range groups {
			got = append(got, fmt.Sprintf("%s=%v", g, m[`hipq_consumer_stalled{group="`+g+`",reason="42501"}`]))
		}
		s := strings.Join(got, " ")
		return !strings.Contains(s, "=0"), s
	}, "every consumer stalled")
	resp, err := http.Get(apiURL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range append(groups, "42501") {
		if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), want) {
			t.Fatalf("/readyz while stalled: %d %s, want 503 naming %s", resp.StatusCode, body, want)
		}
	}
	if n := e.adminScalar(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
		t.Fatalf("%d dead letters while the privilege was revoked", n)
	}
	if n := e.adminScalar(`SELECT count(*) FROM hipq_job`); n != 6 {
		t.Fatalf("%d jobs while the privilege was revoked, want the first 6", n)
	}

	if _, err := e.pool().Exec(ctx, fmt.Sprintf(`GRANT INSERT, UPDATE ON hipq_job TO %s`, pgx.Identifier{role}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"pre-4", "pre-5"} {
		if code, body := callback(key); code != http.StatusOK || !strings.Contains(body, `"applied":true`) {
			t.Fatalf("callback %s once restored: %d %s", key, code, body)
		}
	}
	testutil.Eventually(t, 90*time.Second, func() (bool, string) {
		mid := e.adminScalar(`SELECT count(*) FROM hipq_job WHERE job_key LIKE 'mid-%' OR job_key LIKE 'box-%'`)
		done := e.adminScalar(`SELECT count(*) FROM hipq_job WHERE job_key LIKE 'pre-%' AND state = 'final' AND outcome = 'succeeded'`)
		left := e.adminScalar(`SELECT count(*) FROM hipq_intake`)
		return mid == 7 && done == 6 && left == 0, fmt.Sprintf("%d of 7 new jobs, %d of 6 replied, %d outbox rows left", mid, done, left)
	}, "every record applied once the privileges are back")
	if n := e.adminScalar(`SELECT count(*) FROM (SELECT job_key FROM hipq_job GROUP BY job_key HAVING count(*) > 1) d`); n != 0 {
		t.Fatalf("%d keys with more than one job", n)
	}
	if n := e.adminScalar(`SELECT count(*) FROM hipq_attempt WHERE replied_at IS NOT NULL`); n != 6 {
		t.Fatalf("%d attempts replied, want 6", n)
	}
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		m := scrape(t, a.metrics.Handler())
		var got []string
		for _, g := range groups {
			got = append(got, fmt.Sprintf("%s=%v", g, m[`hipq_consumer_stalled{group="`+g+`",reason="42501"}`]))
		}
		resp, err := http.Get(apiURL + "/readyz")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		s := strings.Join(got, " ")
		return !strings.Contains(s, "=1") && resp.StatusCode == http.StatusOK, fmt.Sprintf("%s, /readyz %d", s, resp.StatusCode)
	}, "the stalls over")
	m := scrape(t, a.metrics.Handler())
	wantMetrics(t, m, map[string]float64{
		`hipq_intake_records_total{result="accepted",source="kafka"}`:  10,
		`hipq_intake_records_total{result="accepted",source="outbox"}`: 3,
		`hipq_replies_total{result="applied",source="kafka"}`:          4,
		`hipq_replies_total{result="applied",source="callback"}`:       2,
	})
	if n := e.adminScalar(`SELECT count(*) FROM hipq_dead_letter`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
}

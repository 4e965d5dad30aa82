package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
)

// kcatRecord is one line of `kcat -C -J`: headers come as a flat list of
// names and values.
type kcatRecord struct {
	Partition int      `json:"partition"`
	Offset    int64    `json:"offset"`
	Headers   []string `json:"headers"`
	Key       *string  `json:"key"`
	Payload   *string  `json:"payload"`
}

func (r kcatRecord) header(name string) string {
	for i := 0; i+1 < len(r.Headers); i += 2 {
		if r.Headers[i] == name {
			return r.Headers[i+1]
		}
	}
	return ""
}

// Issue 33: a foreign client reads the events with no codec added. kcat
// (librdkafka) consumes the events topic from its start after the jobs
// ended: every job has its final event keyed by its job_key, with the
// hipq-* headers naming it and a JSON value that agrees with its row, and
// each retry its attempt event before the job's final one.
func TestKcatReadsEvents(t *testing.T) {
	t.Parallel()
	kcat, err := exec.LookPath("kcat")
	if err != nil {
		t.Skip("kcat is not installed (apt-get install kcat): the events topic is not read by a foreign client")
	}
	e := newEnv(t, eventsTopics...)
	a := e.start(e.config(eventsConfig()))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	e.respond(ctx, "requests", "replies", func(key string, attempt int) (string, bool) {
		switch {
		case key == "kcat-retry" && attempt == 1, key == "kcat-fail":
			return "failed", true
		}
		return "succeeded", true
	})
	keys := []string{"kcat-0", "kcat-1", "kcat-2", "kcat-retry", "kcat-fail"}
	var reqs []string
	for _, k := range keys {
		reqs = append(reqs, jobReq(k))
	}
	e.produce("jobs", reqs...)
	testutil.Eventually(t, time.Minute, func() (bool, string) {
		n, pending := e.countJobs(a, "state = 'final'"), e.adminScalar(pgtest.PendingEventsSQL(""))
		return n == len(keys) && pending == 0, fmt.Sprintf("%d of %d jobs final, %d events not yet relayed", n, len(keys), pending)
	}, "every job ended and its events relayed")

	type job struct {
		id             int64
		attempt        int
		outcome, error string
	}
	jobs := map[string]job{}
	rows, err := e.pool().Query(ctx, "SELECT job_key, id, attempt, outcome, error FROM hipq_job")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k string
		var j job
		if err := rows.Scan(&k, &j.id, &j.attempt, &j.outcome, &j.error); err != nil {
			t.Fatal(err)
		}
		jobs[k] = j
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}

	// -e: stop at the end of every partition, which holds every event now.
	cmd := exec.CommandContext(ctx, kcat, "-C", "-b", strings.Join(e.kafka.Brokers, ","), "-t", e.kafka.Topic("events"),
		"-o", "beginning", "-e", "-q", "-J")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kcat: %v\n%s", err, stderr.String())
	}
	var recs []kcatRecord
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var r kcatRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("kcat line %q: %v", sc.Text(), err)
		}
		recs = append(recs, r)
	}
	// Order within a partition is the order of the topic.
	sort.SliceStable(recs, func(i, j int) bool {
		return recs[i].Partition < recs[j].Partition || recs[i].Partition == recs[j].Partition && recs[i].Offset < recs[j].Offset
	})

	// What each key's events were, in order, as "attempt:outcome".
	got := map[string][]string{}
	seen := map[string]bool{}
	for _, r := range recs {
		if r.Key == nil || r.Payload == nil {
			t.Errorf("event with no key or no value: %+v", r)
			continue
		}
		id := r.header(correlator.HeaderEventID)
		if id == "" || seen[id] {
			t.Errorf("event %s: hipq-event-id %q empty or seen before", *r.Payload, id)
		}
		seen[id] = true
		j, ok := jobs[*r.Key]
		if !ok {
			t.Errorf("event keyed %q, no such job", *r.Key)
			continue
		}
		var v struct {
			JobType    string          `json:"job_type"`
			JobKey     string          `json:"job_key"`
			JobID      int64           `json:"job_id"`
			Attempt    int             `json:"attempt"`
			State      string          `json:"state"`
			Outcome    string          `json:"outcome"`
			Result     json.RawMessage `json:"result"`
			Error      *string         `json:"error"`
			CreatedAt  time.Time       `json:"created_at"`
			FinishedAt time.Time       `json:"finished_at"`
		}
		if err := json.Unmarshal([]byte(*r.Payload), &v); err != nil {
			t.Errorf("event value %q is not the documented JSON: %v", *r.Payload, err)
			continue
		}
		outcome := r.header(correlator.HeaderOutcome)
		wantHeaders := map[string]string{
			correlator.HeaderJobType: "e2e",
			correlator.HeaderJobKey:  *r.Key,
			correlator.HeaderJobID:   strconv.FormatInt(j.id, 10),
			correlator.HeaderAttempt: strconv.Itoa(v.Attempt),
			correlator.HeaderOutcome: v.Outcome,
		}
		for h, want := range wantHeaders {
			if g := r.header(h); g != want {
				t.Errorf("event of %s: header %s = %q, want %q (headers %q)", *r.Key, h, g, want, r.Headers)
			}
		}
		if v.JobType != "e2e" || v.JobKey != *r.Key || v.JobID != j.id || v.CreatedAt.IsZero() || v.FinishedAt.Before(v.CreatedAt) {
			t.Errorf("event of %s (job %d): value %s", *r.Key, j.id, *r.Payload)
		}
		switch outcome {
		case correlator.EventOutcomeRetry:
			if v.State != "retry" || v.Attempt >= j.attempt {
				t.Errorf("retry event of %s (job at attempt %d): value %s", *r.Key, j.attempt, *r.Payload)
			}
		default:
			if v.State != "final" || v.Outcome != j.outcome || v.Attempt != j.attempt {
				t.Errorf("final event of %s (job %s at attempt %d): value %s", *r.Key, j.outcome, j.attempt, *r.Payload)
			}
			if succeeded := v.Outcome == "succeeded"; succeeded != (string(v.Result) != "null") || succeeded != (v.Error == nil) {
				t.Errorf("final event of %s: result %s and error %v after %s", *r.Key, v.Result, v.Error, v.Outcome)
			}
		}
		got[*r.Key] = append(got[*r.Key], fmt.Sprintf("%d:%s", v.Attempt, outcome))
	}
	want := map[string][]string{
		"kcat-0": {"1:succeeded"}, "kcat-1": {"1:succeeded"}, "kcat-2": {"1:succeeded"},
		"kcat-retry": {"1:retry", "2:succeeded"},
		"kcat-fail":  {"1:retry", "2:retry", "3:failed"},
	}
	for _, k := range keys {
		if fmt.Sprint(got[k]) != fmt.Sprint(want[k]) {
			t.Errorf("kcat read %s's events %v, want %v", k, got[k], want[k])
		}
	}
	if t.Failed() {
		t.Logf("kcat output:\n%s", out)
	}
}

package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/internal/testutil"
)

// startAll is `hipq run` with every role but the API in a subprocess.
func startAll(t *testing.T, cfgPath string, extraEnv ...string) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "HIPQ_TEST_MAIN=run --config "+cfgPath+" --only intake,dispatcher,responses,sweeper")
	cmd.Env = append(cmd.Env, extraEnv...)
	p := &proc{cmd: cmd, out: &bytes.Buffer{}, mu: &sync.Mutex{}}
	cmd.Stdout, cmd.Stderr = lockedWriter{p}, lockedWriter{p}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return p
}

// SIGKILL between the commit that ends a job and the delete of its event
// (the event produced, its row still there; crash point
// events:after-produce), 200 jobs: after a restart every job has its
// event on the topic, each event id at least once, and none waits in
// PostgreSQL; the re-sent ones are counted.
func TestEventsSIGKILL(t *testing.T) {
	t.Parallel()
	e := newEnv(t, eventsTopics...)
	text := strings.Replace(strings.Replace(eventsConfig(), "name: e2e", "name: evcrash\nshutdown_timeout: 20s", 1), "timeout: 2s", "timeout: 1m", 1)
	cfgPath := filepath.Join(t.TempDir(), "hipq.yaml")
	if err := os.WriteFile(cfgPath, []byte(e.configText(text)), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := newApp(context.Background(), e.config(text), nopLogger(), appOptions{roles: []string{"sweeper"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.close)
	db := a.st.Pool()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.respond(ctx, "requests", "replies", func(string, int) (string, bool) { return "succeeded", true })
	const n = 200
	var rs []*kgo.Record
	for i := range n {
		rs = append(rs, &kgo.Record{Topic: e.kafka.Topic("jobs"), Value: []byte(jobReq(fmt.Sprintf("job-%03d", i)))})
	}
	e.kafka.Produce(rs...)

	p := startAll(t, cfgPath, "HIPQ_CRASHPOINT=events:after-produce")
	err = p.cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("hipq did not die at the crash point: %v\n%s", err, p.output())
	}
	pendingAtCrash := scalarInt(t, db, pgtest.PendingEventsSQL(""))
	if pendingAtCrash == 0 {
		t.Fatalf("no event waits after the crash:\n%s", p.output())
	}

	p = startAll(t, cfgPath)
	defer p.logOnFailure(t)
	testutil.Eventually(t, 2*time.Minute, func() (bool, string) {
		final := scalarInt(t, db, "SELECT count(*) FROM hipq_job WHERE state = 'final'")
		pending := scalarInt(t, db, pgtest.PendingEventsSQL(""))
		return final == n && pending == 0, fmt.Sprintf("%d final, %d events pending", final, pending)
	}, "every job final and every event relayed")
	cancel() // (the responder's work is done)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Wait(); err != nil {
		t.Fatalf("SIGTERM: %v, want exit 0\n%s", err, p.output())
	}

	// Every record of the topic, the re-sent ones included: hipq is
	// stopped, so what is there now is all there will be.
	cl := e.kafka.Client(kgo.ConsumeTopics(e.kafka.Topic("events")), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer cl.Close()
	var recs []*kgo.Record
	ids := map[string]int{}
	jobs := map[string]bool{}
	deadline := time.Now().Add(time.Minute)
	for quiet := 0; quiet < 2; { // until every job's event came, then one quiet poll more
		pctx, pcancel := context.WithTimeout(context.Background(), time.Second)
		fs := cl.PollFetches(pctx)
		pcancel()
		got := 0
		fs.EachRecord(func(r *kgo.Record) {
			recs = append(recs, r)
			got++
			ids[recHeader(r, correlator.HeaderEventID)]++
			if recHeader(r, correlator.HeaderOutcome) == "succeeded" {
				jobs[recHeader(r, correlator.HeaderJobID)] = true
			}
		})
		switch {
		case len(jobs) < n && time.Now().After(deadline):
			t.Fatalf("final events of %d jobs in a minute, want %d", len(jobs), n)
		case len(jobs) == n && got == 0:
			quiet++
		}
	}
	if len(jobs) != n {
		t.Fatalf("final events of %d jobs, want %d", len(jobs), n)
	}
	if w := scalarInt(t, db, "SELECT count(*) FROM hipq_job WHERE state = 'final'"); w != n {
		t.Fatalf("%d final jobs, want %d", w, n)
	}
	resent := 0
	for _, c := range ids {
		resent += c - 1
	}
	if resent == 0 {
		t.Errorf("no event was sent again, though %d waited after the crash with their batch sent", pendingAtCrash)
	}
	t.Logf("%d jobs, %d events read, %d distinct ids, %d sent again after the crash (%d waited then)", n, len(recs), len(ids), resent, pendingAtCrash)
}

package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/internal/testutil"
)

// proc is `hipq run` in a real subprocess: this test binary, re-executed.
type proc struct {
	cmd *exec.Cmd
	out *bytes.Buffer
	mu  *sync.Mutex
}

func startHipq(t *testing.T, cfgPath string, extraEnv ...string) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "HIPQ_TEST_MAIN=run --config "+cfgPath+" --only intake")
	cmd.Env = append(cmd.Env, extraEnv...)
	p := &proc{cmd: cmd, out: &bytes.Buffer{}, mu: &sync.Mutex{}}
	cmd.Stdout, cmd.Stderr = lockedWriter{p}, lockedWriter{p}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return p
}

type lockedWriter struct{ p *proc }

func (w lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.out.Write(b)
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

func crashEnv(t *testing.T) (*env, string, *pgxpool.Pool) {
	t.Helper()
	e := newEnv(t, e2eTopics...)
	cfgPath := filepath.Join(t.TempDir(), "hipq.yaml")
	text := strings.Replace(e2eConfig, "name: e2e", "name: crash\nshutdown_timeout: 20s", 1)
	if err := os.WriteFile(cfgPath, []byte(e.configText(text)), 0o600); err != nil {
		t.Fatal(err)
	}
	// Migrate before the subprocesses start, and keep a pool for checks.
	cfg := e.config(text)
	a, err := newApp(context.Background(), cfg, nopLogger(), appOptions{roles: []string{"sweeper"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.close)
	return e, cfgPath, a.st.Pool()
}

func scalarInt(t *testing.T, db *pgxpool.Pool, q string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// finalizeAll marks every stored job final, as if it had completed: a
// record applied a second time would then make a second row.
func finalizeAll(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	if _, err := db.Exec(context.Background(), "UPDATE hipq_job SET state = 'final', outcome = 'succeeded', update_time = now() WHERE state <> 'final'"); err != nil {
		t.Fatal(err)
	}
}

// logOnFailure logs what hipq said when the test has failed; deferred, it
// runs after a t.Fatal too.
func (p *proc) logOnFailure(t *testing.T) {
	if t.Failed() {
		t.Logf("hipq said:\n%s", p.output())
	}
}

// waitApplied waits until the stored intake offsets cover n records.
func waitApplied(t *testing.T, db *pgxpool.Pool, n int, p *proc) {
	t.Helper()
	defer p.logOnFailure(t)
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		got := scalarInt(t, db, "SELECT coalesce(sum(next_offset), 0) FROM hipq_offset WHERE consumer_group = 'crash-intake'")
		return got >= n, fmt.Sprintf("%d records", got)
	}, "intake to reach %d records", n)
}

func produceJobs(t *testing.T, e *env, from, to int) {
	t.Helper()
	var rs []*kgo.Record
	for i := from; i < to; i++ {
		rs = append(rs, &kgo.Record{Topic: e.kafka.Topic("jobs"), Value: []byte(jobReq(fmt.Sprintf("job-%05d", i)))})
	}
	e.kafka.Produce(rs...)
}

func checkExactlyOnce(t *testing.T, db *pgxpool.Pool, n int) {
	t.Helper()
	rows := scalarInt(t, db, "SELECT count(*) FROM hipq_job")
	keys := scalarInt(t, db, "SELECT count(DISTINCT job_key) FROM hipq_job")
	if rows != n || keys != n {
		t.Fatalf("%d rows for %d keys from %d records: want exactly one row per record", rows, keys, n)
	}
}

// Invariant 7 across a crash between the PostgreSQL commit and the Kafka
// commit: the process is SIGKILLed right after its first intake commit;
// the restarted one seeks to PostgreSQL's offsets, loses nothing and makes
// no second row. Then SIGTERM drains and exits 0.
func TestCrashBetweenCommitAndKafkaCommit(t *testing.T) {
	t.Parallel()
	e, cfgPath, db := crashEnv(t)
	const n = 60
	produceJobs(t, e, 0, n)
	p := startHipq(t, cfgPath, "HIPQ_CRASHPOINT=crash-intake:after-commit")
	err := p.cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("hipq did not die at the crash point: %v\n%s", err, p.output())
	}
	first := scalarInt(t, db, "SELECT count(*) FROM hipq_job")
	if first == 0 {
		t.Fatalf("nothing was committed before the crash:\n%s", p.output())
	}
	finalizeAll(t, db)

	// The restart reads the same records again from Kafka (their group
	// commit never happened) plus new ones: only the new ones apply.
	p = startHipq(t, cfgPath)
	produceJobs(t, e, n, 2*n)
	waitApplied(t, db, 2*n, p)
	checkExactlyOnce(t, db, 2*n)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Wait(); err != nil {
		t.Fatalf("SIGTERM: %v, want exit 0\n%s", err, p.output())
	}
	t.Logf("%d of %d records were committed before the crash", first, n)
}

// SIGKILL at random moments while records keep arriving: after a final
// restart every record is a job, exactly once.
func TestSIGKILLAtRandomMoments(t *testing.T) {
	t.Parallel()
	e, cfgPath, db := crashEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	var finalizer, producer sync.WaitGroup
	t.Cleanup(func() { cancel(); finalizer.Wait(); producer.Wait() })
	finalizer.Add(1)
	go func() {
		defer finalizer.Done()
		for ctx.Err() == nil {
			_, _ = db.Exec(ctx, "UPDATE hipq_job SET state = 'final', outcome = 'succeeded', update_time = now() WHERE state <> 'final'")
			time.Sleep(10 * time.Millisecond)
		}
	}()
	// Records keep arriving while hipq is killed and restarted.
	cl := e.kafka.Client()
	defer cl.Close()
	var produced atomic.Int64
	var stop atomic.Bool
	producer.Add(1)
	go func() {
		defer producer.Done()
		for i := 0; stop.Load() == false && ctx.Err() == nil; i++ {
			var rs []*kgo.Record
			for k := i * 10; k < i*10+10; k++ {
				rs = append(rs, &kgo.Record{Topic: e.kafka.Topic("jobs"), Value: []byte(jobReq(fmt.Sprintf("job-%05d", k)))})
			}
			pctx, pcancel := context.WithTimeout(ctx, 10*time.Second)
			err := cl.ProduceSync(pctx, rs...).FirstErr()
			pcancel()
			if err != nil {
				return
			}
			produced.Store(int64(i*10 + 10))
			time.Sleep(20 * time.Millisecond)
		}
	}()
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	for round := range 4 {
		before := scalarInt(t, db, "SELECT count(*) FROM hipq_job")
		p := startHipq(t, cfgPath)
		deadline := time.Now().Add(60 * time.Second)
		for scalarInt(t, db, "SELECT count(*) FROM hipq_job") == before {
			if time.Now().After(deadline) {
				_ = p.cmd.Process.Kill()
				_ = p.cmd.Wait()
				t.Fatalf("round %d: nothing applied within 60s:\n%s", round, p.output())
			}
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(time.Duration(r.IntN(400)) * time.Millisecond) // a random moment of consuming, not a wait for a condition
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
		t.Logf("round %d: killed with %d rows stored", round, scalarInt(t, db, "SELECT count(*) FROM hipq_job"))
	}
	stop.Store(true)
	producer.Wait()
	p := startHipq(t, cfgPath)
	defer func() { _ = p.cmd.Process.Kill() }()
	total := int(produced.Load())
	waitApplied(t, db, total, p)
	cancel()
	finalizer.Wait()
	finalizeAll(t, db)
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	_ = p.cmd.Wait()
	checkExactlyOnce(t, db, total)
}

package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/hipq/hipq/internal/testutil"
)

// writeOutbox is an application writing the outbox in transactions of 50
// rows, keys job-00000 on, until stop; it returns how many rows committed.
func writeOutbox(ctx context.Context, db *pgxpool.Pool, stop *atomic.Bool, written *atomic.Int64) {
	for i := 0; !stop.Load() && ctx.Err() == nil; i++ {
		_, err := db.Exec(ctx, `INSERT INTO hipq_intake (value)
			SELECT format('{"job_type": "e2e", "job_key": "job-%s"}', lpad(g::text, 5, '0'))
			FROM generate_series($1::int, $2::int) g`, i*50, i*50+49)
		if err != nil {
			return
		}
		written.Store(int64(i*50 + 50))
		time.Sleep(5 * time.Millisecond)
	}
}

// waitOutboxDrained waits until the outbox is empty and n jobs exist.
func waitOutboxDrained(t *testing.T, db *pgxpool.Pool, n int, p *proc) {
	t.Helper()
	defer p.logOnFailure(t)
	testutil.Eventually(t, 60*time.Second, func() (bool, string) {
		left, jobs := scalarInt(t, db, "SELECT count(*) FROM hipq_intake"), scalarInt(t, db, "SELECT count(*) FROM hipq_job")
		return left == 0 && jobs >= n, fmt.Sprintf("%d rows left, %d jobs", left, jobs)
	}, "the outbox to be drained into %d jobs", n)
}

// Issue 12: hipq killed with SIGKILL while draining the outbox — inside a
// drain transaction, and at random moments while the application keeps
// writing — loses no row and applies none twice (jobs are made final as
// they come, so a row applied twice would make a second job).
func TestOutboxSIGKILL(t *testing.T) {
	t.Parallel()
	_, cfgPath, db := crashEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	t.Cleanup(func() { cancel(); bg.Wait() })
	bg.Add(1)
	go func() {
		defer bg.Done()
		for ctx.Err() == nil {
			_, _ = db.Exec(ctx, "UPDATE hipq_job SET state = 'final', outcome = 'succeeded', update_time = now() WHERE state <> 'final'")
			time.Sleep(10 * time.Millisecond)
		}
	}()
	var stop atomic.Bool
	var written atomic.Int64
	var writer sync.WaitGroup
	writer.Add(1)
	go func() { defer writer.Done(); writeOutbox(ctx, db, &stop, &written) }()
	t.Cleanup(func() { stop.Store(true); writer.Wait() })
	for written.Load() == 0 {
		time.Sleep(time.Millisecond)
	}

	// Killed inside its first drain transaction: the rows it deleted are back.
	p := startHipq(t, cfgPath, "HIPQ_CRASHPOINT=outbox:in-transaction")
	err := p.cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("hipq did not die at the crash point: %v\n%s", err, p.output())
	}
	if n := scalarInt(t, db, "SELECT count(*) FROM hipq_job"); n != 0 {
		t.Fatalf("%d jobs committed by a transaction killed before its commit", n)
	}

	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	for round := range 4 {
		before := scalarInt(t, db, "SELECT count(*) FROM hipq_job")
		p := startHipq(t, cfgPath)
		deadline := time.Now().Add(60 * time.Second)
		for scalarInt(t, db, "SELECT count(*) FROM hipq_job") == before {
			if time.Now().After(deadline) {
				_ = p.cmd.Process.Kill()
				_ = p.cmd.Wait()
				t.Fatalf("round %d: nothing drained within 60s:\n%s", round, p.output())
			}
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(time.Duration(r.IntN(300)) * time.Millisecond) // a random moment of draining, not a wait for a condition
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
		t.Logf("round %d: killed with %d jobs, %d rows waiting", round,
			scalarInt(t, db, "SELECT count(*) FROM hipq_job"), scalarInt(t, db, "SELECT count(*) FROM hipq_intake"))
	}
	stop.Store(true)
	writer.Wait()
	p = startHipq(t, cfgPath)
	defer func() { _ = p.cmd.Process.Kill(); _ = p.cmd.Wait() }()
	total := int(written.Load())
	waitOutboxDrained(t, db, total, p)
	checkExactlyOnce(t, db, total)
	if n := scalarInt(t, db, "SELECT count(*) FROM hipq_dead_letter"); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
	t.Logf("%d rows, each one job", total)
}

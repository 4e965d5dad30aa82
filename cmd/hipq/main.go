// Command hipq is the durable request/response correlator: it keeps jobs in
// PostgreSQL, sends their requests over Kafka, and matches the replies.
//
//	hipq run --config hipq.yaml [--only intake,dispatcher,responses,sweeper,api]
//	hipq migrate [up|status] --config hipq.yaml [--distribute]
//	hipq check-config --config hipq.yaml [--database]
//	hipq demo
//	hipq bench [-n 20000] [--json]
//	hipq jobs get|list|cancel|replay|run-now ...
//	hipq queues pause|resume QUEUE
//	hipq dead-letters list|replay ...
//	hipq operations get|stop ID
//	hipq schedules list|pause|resume|trigger ... | next NAME --config FILE
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/hipq/hipq/config"
	"github.com/hipq/hipq/internal/memlimit"
	"github.com/hipq/hipq/store"
)

const usage = `hipq — durable request/response correlator

Usage:
  hipq run --config FILE [--only intake,dispatcher,responses,sweeper,api]
  hipq migrate [up|status] --config FILE [--distribute]
  hipq check-config --config FILE [--database]
  hipq demo
  hipq bench [-n N] [--json]
  hipq jobs get|list|cancel|replay|run-now ...
  hipq queues pause|resume QUEUE
  hipq dead-letters list|replay ...
  hipq operations get|stop ID
  hipq schedules list | pause|resume|trigger NAME
  hipq schedules next NAME --config FILE [--from RFC3339] [--count N]
  hipq version

` + remoteUsage

func main() {
	os.Exit(runMain(os.Args[1:], os.Stdout, os.Stderr))
}

// exitError carries an exit code.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }

func runMain(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	var err error
	switch args[0] {
	case "run":
		err = cmdRun(args[1:], stderr)
	case "migrate":
		err = cmdMigrate(args[1:], stdout)
	case "check-config":
		err = cmdCheckConfig(args[1:], stdout)
	case "demo":
		err = cmdDemo(args[1:], stdout)
	case "bench":
		err = cmdBench(args[1:], stdout)
	case "jobs":
		err = cmdJobs(args[1:], stdout)
	case "queues":
		err = cmdQueues(args[1:], stdout)
	case "dead-letters":
		err = cmdDeadLetters(args[1:], stdout)
	case "operations":
		err = cmdOperations(args[1:], stdout)
	case "schedules":
		err = cmdSchedules(args[1:], stdout)
	case "version", "--version", "-v":
		cmdVersion(stdout)
		return 0
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "hipq: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
	if err == nil {
		return 0
	}
	fmt.Fprintln(stderr, "hipq:", err)
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	return 1
}

func configFlag(fs *flag.FlagSet) *string {
	return fs.String("config", os.Getenv("HIPQ_CONFIG"), "config file (or $HIPQ_CONFIG)")
}

func loadConfig(path string) (*config.Config, error) {
	if path == "" {
		return nil, &exitError{2, errors.New("--config is required")}
	}
	cfg, err := config.Load(path)
	if err != nil {
		var ce config.Errors
		if errors.As(err, &ce) {
			return nil, &exitError{2, err}
		}
		return nil, err
	}
	return cfg, nil
}

func newLogger(level, format string, w io.Writer) *zap.Logger {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		lvl = zapcore.InfoLevel
	}
	ec := zap.NewProductionEncoderConfig()
	ec.EncodeTime = zapcore.ISO8601TimeEncoder
	var enc zapcore.Encoder
	if format == "console" {
		enc = zapcore.NewConsoleEncoder(ec)
	} else {
		enc = zapcore.NewJSONEncoder(ec)
	}
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(w), lvl))
}

func cmdRun(args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	cfgPath := configFlag(fs)
	only := fs.String("only", "", "comma-separated roles to run (default: all)")
	if err := fs.Parse(args); err != nil {
		return &exitError{2, err}
	}
	roles, err := parseRoles(*only)
	if err != nil {
		return &exitError{2, err}
	}
	cfg, err := loadConfig(*cfgPath)
	if err != nil {
		return err
	}
	log := newLogger(cfg.Log.Level, cfg.Log.Format, stderr)
	defer log.Sync()                                      //nolint:errcheck // it fails on terminals and pipes, and at exit there is no one to tell
	if path := os.Getenv("HIPQ_CPUPROFILE"); path != "" { // hipq bench --cpuprofile
		f, err := os.Create(path)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if path := os.Getenv("HIPQ_MEMPROFILE"); path != "" { // hipq bench --memprofile
		go func() {
			if err := watchHeapPeak(ctx, path, 50*time.Millisecond); err != nil {
				log.Warn("cannot write the heap profile", zap.String("path", path), zap.Error(err))
			}
		}()
	}
	limit, err := applyMemoryLimit(ctx, cfg, log, memlimit.System())
	if err != nil {
		return err
	}
	a, err := newApp(ctx, cfg, log, appOptions{roles: roles, startTimeout: time.Minute, memoryLimit: limit})
	if err != nil {
		return err
	}
	defer a.close()
	done := make(chan error, 1)
	go func() { done <- a.run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down: no new claims; draining", zap.Duration("timeout", cfg.ShutdownTimeout.D()))
	select {
	case err := <-done:
		log.Info("drained; bye")
		return err
	case <-time.After(cfg.ShutdownTimeout.D()):
		return &exitError{1, fmt.Errorf("drain overran shutdown_timeout (%v); what was left is timed out and retried later", cfg.ShutdownTimeout.D())}
	}
}

// applyMemoryLimit resolves the memory limit (memory_limit, GOMEMLIMIT, the
// cgroup's, the default), holds the Go runtime's soft limit to its share
// of it until ctx ends (memlimit.Keep), and logs it, where it came from and
// what the runtime and the buffers get of it.
func applyMemoryLimit(ctx context.Context, cfg *config.Config, log *zap.Logger, env memlimit.Env) (int64, error) {
	lim, err := memlimit.Resolve(int64(cfg.MemoryLimit), env)
	if err != nil {
		return 0, &exitError{2, err}
	}
	if lim.Bytes < memlimit.Min {
		log.Warn("memory limit below hipq's minimum: the binary and the heap at rest nearly fill it",
			zap.String("limit", memlimit.Format(lim.Bytes)), zap.String("from", lim.Origin()), zap.String("minimum", memlimit.Format(memlimit.Min)))
	}
	if lim.Asked > 0 {
		log.Warn("memory limit above 90% of the cgroup's limit; using 90% of the cgroup's", zap.String("from", string(lim.From)),
			zap.String("asked", memlimit.Format(lim.Asked)), zap.String("cgroup_limit", memlimit.Format(lim.Cgroup)),
			zap.String("cgroup_file", lim.CgroupFile), zap.String("limit", memlimit.Format(lim.Bytes)))
	}
	// The runtime's share follows the binary's resident pages: applied
	// now, the pages initialization touched released, and again every
	// second.
	runtime := memlimit.Apply(lim.Bytes, env.Root)
	memlimit.ReleaseBinaryPages(lim.Bytes)
	gcPercent := memlimit.ApplyGCPercent(env)
	go memlimit.Keep(ctx, lim.Bytes, env.Root, time.Second)
	split, producer := memorySplit(cfg, lim.Bytes)
	log.Info("memory limit", zap.String("limit", memlimit.Format(lim.Bytes)), zap.Int64("bytes", lim.Bytes), zap.String("from", lim.Origin()),
		zap.Int64("runtime_soft_limit_bytes", runtime), zap.Int("gc_percent", gcPercent),
		zap.Int32("fetch_max_bytes", split.FetchMaxBytes), zap.Int32("fetch_max_partition_bytes", split.FetchMaxPartitionBytes),
		zap.Int("max_concurrent_fetches", split.MaxConcurrentFetches), zap.Int64("producer_buffered_bytes", producer),
		zap.Int32("max_decompress_batch_bytes", split.MaxDecompressBatchBytes))
	return lim.Bytes, nil
}

func cmdMigrate(args []string, stdout io.Writer) error {
	sub := "up"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		sub, args = args[0], args[1:]
	}
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	cfgPath := configFlag(fs)
	moveRows := fs.Bool("distribute", false, "on Citus, also move the rows of a schema laid out on one PostgreSQL onto the cluster's layout (stop every hipq first)")
	if err := fs.Parse(args); err != nil {
		return &exitError{2, err}
	}
	if sub != "up" && sub != "status" {
		return &exitError{2, fmt.Errorf("migrate: unknown subcommand %q (up or status)", sub)}
	}
	if *moveRows && sub != "up" {
		return &exitError{2, fmt.Errorf("migrate: --distribute goes with up, not %s", sub)}
	}
	cfg, err := loadConfig(*cfgPath)
	if err != nil {
		return err
	}
	ctx := context.Background()
	st, err := openStore(ctx, cfg)
	if err != nil {
		return err
	}
	defer st.Close()
	if sub == "up" {
		migrate := st.Migrate
		if *moveRows {
			migrate = func(ctx context.Context) ([]store.Migration, error) { return st.MigrateDistribute(ctx, cfg.Domain()) }
		}
		applied, err := migrate(ctx)
		if err != nil {
			return err
		}
		if len(applied) == 0 {
			fmt.Fprintln(stdout, "schema is up to date")
		}
		for _, m := range applied {
			fmt.Fprintf(stdout, "applied %s\n", m)
		}
		return nil
	}
	ms, current, err := st.MigrationStatus(ctx)
	if err != nil {
		return err
	}
	rs, err := st.RepeatableStatus(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "schema version %d (this hipq knows %d)\n", current, len(ms))
	for _, m := range append(ms, rs...) {
		at := "pending"
		if m.AppliedAt != nil {
			at = "applied " + m.AppliedAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(stdout, "  %s  %s\n", m, at)
	}
	return nil
}

func cmdCheckConfig(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("check-config", flag.ContinueOnError)
	cfgPath := configFlag(fs)
	database := fs.Bool("database", false, "also check the config against the database at database.url")
	if err := fs.Parse(args); err != nil {
		return &exitError{2, err}
	}
	cfg, err := loadConfig(*cfgPath)
	if err != nil {
		return err
	}
	fmt.Fprint(stdout, "# effective config (secrets redacted)\n"+cfg.Redacted())
	if !*database {
		return nil
	}
	ctx := context.Background()
	st, err := openStore(ctx, cfg)
	if err != nil {
		return err
	}
	defer st.Close()
	return checkQueueMoves(ctx, cfg, st)
}

// checkQueueMoves refuses a config that gives a job type another queue
// than the one its non-final jobs are in: one non-final job per type and
// key is kept per queue on Citus (and replies look for a job in its
// type's queue first), so a type changes queue only once its jobs there
// have ended.
func checkQueueMoves(ctx context.Context, cfg *config.Config, st *store.Store) error {
	queueOf := map[string]string{}
	index := map[string]int{}
	for i, jt := range cfg.JobTypes {
		queueOf[jt.Name] = jt.Queue
		index[jt.Name] = i
	}
	found, err := st.NonFinalElsewhere(ctx, queueOf)
	if err != nil {
		return err
	}
	var problems config.Errors
	for i := 0; i < len(found); {
		jt := found[i].JobType
		var total int64
		var where []string
		for ; i < len(found) && found[i].JobType == jt; i++ {
			total += found[i].Count
			where = append(where, fmt.Sprintf("%q (%d)", found[i].Queue, found[i].Count))
		}
		in := "queue " + strconv.Quote(found[i-1].Queue)
		if len(where) > 1 {
			in = "queues " + strings.Join(where, ", ")
		}
		jobs := fmt.Sprintf("%d non-final jobs of type %s are", total, jt)
		if total == 1 {
			jobs = fmt.Sprintf("1 non-final job of type %s is", jt)
		}
		problems = append(problems, config.Problem{
			Path: fmt.Sprintf("job_types[%d].queue", index[jt]),
			Reason: fmt.Sprintf("%q, but %s in %s: let them end (or cancel them) before changing the type's queue",
				queueOf[jt], jobs, in),
		})
	}
	if len(problems) > 0 {
		return &exitError{2, problems}
	}
	return nil
}

func splitComma(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

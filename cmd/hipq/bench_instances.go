package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// instance is one hipq process of a bench run.
type instance struct {
	n       int
	cmd     *exec.Cmd
	metrics string // its /metrics URL
	config  string // its config file, in a directory of the bench's own
	done    chan struct{}
	err     error
	// portTaken: it said its API's port was in use
	portTaken atomic.Bool
}

type exitedInstance struct {
	n   int
	err error
}

// startInstances starts o.instances hipq processes (hipq run) on the bench's
// config, each with an API on a free loopback port for its /metrics, and
// waits until each is ready.
func startInstances(ctx context.Context, sb *sandbox, dbURL, conf, schema string, o *benchOpts) ([]*instance, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find hipq's binary: %w", err)
	}
	dir, err := os.MkdirTemp("", "hipq-bench-")
	if err != nil {
		return nil, err
	}
	var out []*instance
	defer func() {
		if len(out) == 0 { // stopInstances removes it once an instance started
			_ = os.RemoveAll(dir)
		}
	}()
	start := func(i int) (*instance, error) {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		text := strings.NewReplacer("BROKERS", strings.Join(sb.brokers, ","), "SCHEMA", schema).Replace(conf) +
			fmt.Sprintf("api: {listen: \"127.0.0.1:%d\", public_url: \"http://127.0.0.1:%d\", callback_secret: %q}\n",
				port, port, strings.Repeat("b", 32))
		path := filepath.Join(dir, fmt.Sprintf("hipq-%d.yaml", i+1))
		if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
			return nil, err
		}
		cmd := exec.CommandContext(ctx, exe, "run", "--config", path)
		cmd.Env = append(os.Environ(), "DB="+dbURL)
		if testing.Testing() { // a test binary runs hipq's main when asked so
			cmd.Args = []string{exe}
			cmd.Env = append(cmd.Env, "HIPQ_TEST_MAIN=run --config "+path)
		}
		if i == 0 && o.cpuProfile != "" {
			cmd.Env = append(cmd.Env, "HIPQ_CPUPROFILE="+o.cpuProfile)
		}
		if i == 0 && o.memProfile != "" {
			cmd.Env = append(cmd.Env, "HIPQ_MEMPROFILE="+o.memProfile)
		}
		in := &instance{n: i + 1, config: path, metrics: fmt.Sprintf("http://127.0.0.1:%d/metrics", port), done: make(chan struct{})}
		cmd.Stdout, cmd.Stderr = os.Stderr, &portWatch{w: os.Stderr, taken: &in.portTaken}
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM} // a bench killed outright leaves no instance behind
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 20 * time.Second
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("start hipq instance %d: %w", i+1, err)
		}
		in.cmd = cmd
		go func() { in.err = cmd.Wait(); close(in.done) }()
		return in, nil
	}
	for i := range o.instances {
		in, err := start(i)
		if err != nil {
			return out, err
		}
		out = append(out, in)
	}
	for k := 0; k < len(out); k++ {
		in := out[k]
		ready := strings.TrimSuffix(in.metrics, "/metrics") + "/readyz"
		deadline := time.Now().Add(60 * time.Second)
		for tries := 1; ; {
			resp, err := http.Get(ready)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
			}
			select {
			case <-in.done:
				// The port freePort found free was taken before the
				// instance listened on it (another process of the
				// machine's): the instance starts again on another.
				if in.portTaken.Load() && tries < 3 {
					tries++
					next, err := start(in.n - 1)
					if err != nil {
						return out, err
					}
					out[k], in = next, next
					ready = strings.TrimSuffix(in.metrics, "/metrics") + "/readyz"
					continue
				}
				return out, fmt.Errorf("hipq instance %d exited at start: %v", in.n, in.err)
			default:
			}
			if time.Now().After(deadline) {
				return out, fmt.Errorf("hipq instance %d not ready within 60s (%v)", in.n, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return out, nil
}

// portWatch passes an instance's output on to w, and notes when it says
// its API's port was taken.
type portWatch struct {
	w     io.Writer
	taken *atomic.Bool
}

func (p *portWatch) Write(b []byte) (int, error) {
	if bytes.Contains(b, []byte("address already in use")) {
		p.taken.Store(true)
	}
	return p.w.Write(b)
}

// stopInstances stops the instances (SIGTERM: they drain), waits, and
// removes their config files.
func stopInstances(insts []*instance) {
	defer func() {
		if len(insts) > 0 {
			_ = os.RemoveAll(filepath.Dir(insts[0].config))
		}
	}()
	for _, in := range insts {
		_ = in.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, in := range insts {
		select {
		case <-in.done:
		case <-time.After(30 * time.Second):
			_ = in.cmd.Process.Kill()
			<-in.done
		}
	}
}

// exited yields the first instance that stopped.
func exited(insts []*instance) <-chan exitedInstance {
	ch := make(chan exitedInstance, 1)
	for _, in := range insts {
		select {
		case <-in.done:
			ch <- exitedInstance{in.n, exitErr(in.err)}
			return ch
		default:
		}
	}
	return ch
}

// exitErr says why an instance stopped: its error, or that it exited.
func exitErr(err error) error {
	if err == nil {
		return errors.New("exited")
	}
	return err
}

// peakRSS is the instance's high-water resident set (VmHWM).
func (in *instance) peakRSS() int64 {
	return vmHWM(fmt.Sprintf("/proc/%d/status", in.cmd.Process.Pid))
}

// gauge is the value of a series of the instance's /metrics without
// labels (name value).
func (in *instance) gauge(ctx context.Context, name string) (float64, error) {
	var v float64
	found := false
	err := in.metricLines(ctx, http.DefaultClient, func(line string) {
		if rest, ok := strings.CutPrefix(line, name+" "); ok {
			v, found = 0, true
			if f, err := strconv.ParseFloat(rest, 64); err == nil {
				v = f
			}
		}
	})
	if err == nil && !found {
		err = fmt.Errorf("hipq instance %d serves no %s", in.n, name)
	}
	return v, err
}

// scrapeInstances sums the instances' metrics: series as printed
// (name{labels}) to values, and each name alone summed over its labels.
func scrapeInstances(ctx context.Context, insts []*instance) (map[string]float64, error) {
	sum := map[string]float64{}
	for _, in := range insts {
		if err := in.metricLines(ctx, http.DefaultClient, func(line string) { addMetric(line, sum) }); err != nil {
			return nil, err
		}
	}
	return sum, nil
}

// metricLines reads the instance's /metrics, a line at a time.
func (in *instance) metricLines(ctx context.Context, client *http.Client, line func(string)) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, in.metrics, nil)
	// Uncompressed: the bench reads ten times a second, and gzipping each
	// page would take CPU from the instance it measures.
	req.Header.Set("Accept-Encoding", "identity")
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("read the metrics of hipq instance %d: %w", in.n, err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line(sc.Text())
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read the metrics of hipq instance %d: %w", in.n, err)
	}
	return nil
}

// waitBalanced waits until each group's partitions are all assigned, each
// to one instance, and every instance has some of each group's (as their
// /metrics' consumer lag series say: one per partition assigned there).
func waitBalanced(ctx context.Context, insts []*instance, groups []string, partitions int) error {
	group := regexp.MustCompile(`^hipq_consumer_lag_records\{.*group="([^"]*)"`)
	client := &http.Client{Timeout: 5 * time.Second} // a hung /metrics fails the wait, never holds it
	deadline := time.Now().Add(60 * time.Second)
	for {
		balanced := true
		total := map[string]int{}
		for _, in := range insts {
			mine := map[string]int{}
			if err := in.metricLines(ctx, client, func(line string) {
				if m := group.FindStringSubmatch(line); m != nil {
					mine[m[1]]++
				}
			}); err != nil {
				return err
			}
			for _, g := range groups {
				total[g] += mine[g]
				balanced = balanced && (mine[g] > 0 || len(insts) > partitions)
			}
		}
		for _, g := range groups {
			balanced = balanced && total[g] == partitions
		}
		if balanced {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the consumer groups were not shared among the instances within 60s (partitions assigned: %v)", total)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// addMetric adds a /metrics line's value to its series and to its name.
func addMetric(line string, sum map[string]float64) {
	if line == "" || line[0] == '#' {
		return
	}
	i := strings.LastIndexByte(line, ' ')
	if i < 0 {
		return
	}
	v, err := strconv.ParseFloat(line[i+1:], 64)
	if err != nil {
		return
	}
	series := line[:i]
	sum[series] += v
	if name, _, ok := strings.Cut(series, "{"); ok {
		sum[name] += v
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// vmHWM reads a process's peak resident set from its status file.
func vmHWM(path string) int64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return 0
}

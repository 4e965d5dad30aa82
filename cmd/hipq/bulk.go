package main

// Bulk actions from a terminal: hipq jobs cancel|replay|run-now and hipq
// dead-letters replay with filter flags, and hipq operations get|stop.

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hipq/hipq/api"
)

// bulkFlags are a bulk action's flags: the filter's (by API field name),
// the reason, dry run, and whether to wait for the end.
type bulkFlags struct {
	filter map[string]*string
	times  []string // the filter fields that are times
	names  []string // the flags these are: given, they ask for a bulk action
	reason *string
	dryRun *bool
	noWait *bool
	// poll is how often a running operation is read until it ends.
	poll time.Duration
}

func newBulkFlags(fs *flag.FlagSet) *bulkFlags {
	return &bulkFlags{filter: map[string]*string{}, names: []string{"reason", "dry-run", "no-wait"},
		reason: fs.String("reason", "", "why (required; logged and kept with the operation)"),
		dryRun: fs.Bool("dry-run", false, "print how many match; change nothing"),
		noWait: fs.Bool("no-wait", false, "do not wait for an operation that outlasts the request"),
		poll:   time.Second}
}

// text adds a filter flag for an API field.
func (b *bulkFlags) text(fs *flag.FlagSet, name, field, usage string) {
	b.filter[field] = fs.String(name, "", usage)
	b.names = append(b.names, name)
}

// time adds a filter flag whose value is a time.
func (b *bulkFlags) time(fs *flag.FlagSet, name, field, usage string) {
	b.text(fs, name, field, usage+" (RFC 3339, or a duration back from now such as 2h)")
	b.times = append(b.times, field)
}

func jobFilterFlags(fs *flag.FlagSet) *bulkFlags {
	b := newBulkFlags(fs)
	b.text(fs, "queue", "queue", "jobs of this queue")
	b.text(fs, "type", "job_type", "jobs of this job type")
	b.text(fs, "state", "state", "jobs in this state")
	b.text(fs, "outcome", "outcome", "final jobs with this outcome (replay)")
	b.text(fs, "key-prefix", "key_prefix", "jobs whose key starts with this")
	b.time(fs, "since", "created_after", "jobs created at or after")
	b.time(fs, "created-before", "created_before", "jobs created before")
	b.time(fs, "updated-after", "updated_after", "jobs last updated at or after")
	b.time(fs, "updated-before", "updated_before", "jobs last updated before")
	return b
}

func deadLetterFilterFlags(fs *flag.FlagSet) *bulkFlags {
	b := newBulkFlags(fs)
	b.text(fs, "source", "source", "dead letters from intake, outbox, reply or callback")
	b.text(fs, "reason-prefix", "reason_prefix", `dead letters whose reason starts with this ("unknown_job_type:")`)
	b.time(fs, "since", "received_after", "dead letters received at or after")
	b.time(fs, "until", "received_before", "dead letters received before")
	return b
}

// set reports whether any flag of a bulk action was given (the
// connection's flags, --server, --token, --ca-file, --json, are not).
func (b *bulkFlags) set(fs *flag.FlagSet) bool {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || slices.Contains(b.names, f.Name) })
	return given
}

// body is the API request of the flags: the filter's fields given, times
// made absolute.
func (b *bulkFlags) body(now time.Time) (map[string]any, error) {
	filter := map[string]string{}
	for field, v := range b.filter {
		if *v == "" {
			continue
		}
		filter[field] = *v
		if !slices.Contains(b.times, field) {
			continue
		}
		if _, err := time.Parse(time.RFC3339Nano, *v); err == nil {
			continue
		}
		d, err := time.ParseDuration(*v)
		if err != nil || d < 0 {
			return nil, fmt.Errorf("%q is neither an RFC 3339 time nor a duration back from now (2h)", *v)
		}
		filter[field] = now.Add(-d).UTC().Format(time.RFC3339Nano)
	}
	if *b.reason == "" {
		return nil, errors.New("--reason is required: say why (it is logged and kept with the operation)")
	}
	body := map[string]any{"filter": filter, "reason": *b.reason}
	if *b.dryRun {
		body["dry_run"] = true
	}
	return body, nil
}

// bulk runs a bulk action and prints its counts; an operation that
// outlasts the request is read until it ends (unless --no-wait).
func (r *remote) bulk(b *bulkFlags, path string) error {
	body, err := b.body(time.Now())
	if err != nil {
		return &exitError{2, fmt.Errorf("%s: %w", strings.TrimPrefix(path, "/v1/"), err)}
	}
	var out struct {
		DryRun    bool           `json:"dry_run"`
		Kind      string         `json:"kind"`
		Filter    map[string]any `json:"filter"`
		Matched   int64          `json:"matched"`
		Operation *api.Operation `json:"operation"`
	}
	raw, err := r.call(http.MethodPost, path, nil, body, &out)
	if err != nil {
		return err
	}
	if out.DryRun {
		if r.json {
			return r.printJSON(raw)
		}
		fmt.Fprintf(r.out, "dry run of %s: %d match %s\n", out.Kind, out.Matched, filterText(out.Filter))
		return nil
	}
	op := out.Operation
	if op == nil {
		return fmt.Errorf("POST %s: the answer has no operation (is --server a hipq API?)", path)
	}
	for op.State == "running" && !*b.noWait {
		time.Sleep(b.poll)
		var again struct {
			Operation *api.Operation `json:"operation"`
		}
		if raw, err = r.call(http.MethodGet, fmt.Sprintf("/v1/operations/%d", op.ID), nil, nil, &again); err != nil {
			return err
		}
		if again.Operation != nil {
			op = again.Operation
		}
	}
	if r.json {
		return r.printJSON(raw)
	}
	printOperation(r.out, op)
	return nil
}

// printOperation prints an operation on one line.
func printOperation(w io.Writer, op *api.Operation) {
	filter, _ := op.Filter.(map[string]any)
	fmt.Fprintf(w, "operation %d %s %s: matched %d, done %d, skipped %d; filter %s\n", op.ID, op.Kind, op.State,
		op.Matched, op.Done, op.Skipped, filterText(filter))
	if op.State == "running" {
		fmt.Fprintf(w, "it goes on; follow it with: hipq operations get %d\n", op.ID)
	}
}

// filterText shows a filter as its fields, in a set order.
func filterText(f map[string]any) string {
	var parts []string
	for _, k := range []string{"queue", "job_type", "state", "outcome", "key_prefix", "source", "reason_prefix", "created_after",
		"created_before", "updated_after", "updated_before", "received_after", "received_before"} {
		if v, ok := f[k]; ok {
			parts = append(parts, fmt.Sprintf("%s=%v", k, v))
		}
	}
	return strings.Join(parts, " ")
}

func cmdOperations(args []string, stdout io.Writer) error {
	if len(args) == 0 || (args[0] != "get" && args[0] != "stop") {
		return &exitError{2, errors.New("operations: want get ID or stop ID")}
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("operations "+sub, flag.ContinueOnError)
	r := remoteFlags(fs)
	r.out = stdout
	pos, err := parseArgs(fs, args, 1, "ID")
	if err != nil {
		return err
	}
	id, err := strconv.ParseInt(pos[0], 10, 64)
	if err != nil || id < 1 {
		return &exitError{2, fmt.Errorf("operations %s: %q is not an operation id", sub, pos[0])}
	}
	method := http.MethodGet
	if sub == "stop" {
		method = http.MethodDelete
	}
	var out struct {
		Operation api.Operation `json:"operation"`
	}
	if done, err := r.do(method, fmt.Sprintf("/v1/operations/%d", id), nil, &out); done {
		return err
	}
	printOperation(stdout, &out.Operation)
	return nil
}

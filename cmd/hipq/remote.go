package main

// The API from a terminal: hipq jobs, hipq queues, hipq dead-letters.

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/hipq/hipq/api"
	"github.com/hipq/hipq/internal/tlsconf"
	"github.com/hipq/hipq/store"
)

const remoteUsage = `The API from a terminal (server from --server or $HIPQ_API_URL, token from
--token or $HIPQ_API_TOKEN, the CA of an https server's certificate from --ca-file or
$HIPQ_API_CA_FILE when no system root signed it; --json prints the API's JSON):

  hipq jobs get TYPE KEY
  hipq jobs list [--type T] [--state S] [--queue Q] [--limit N] [--cursor C]
  hipq jobs cancel TYPE KEY
  hipq jobs replay TYPE KEY
  hipq jobs cancel|replay|run-now --reason WHY FILTER... [--dry-run] [--no-wait]
      every job the filter matches; FILTER is one or more of --queue Q,
      --type T, --state S, --outcome O, --key-prefix P, --since T (created
      at or after), --created-before T, --updated-after T, --updated-before T;
      a time T is RFC 3339 or a duration back from now (2h)
  hipq queues pause QUEUE
  hipq queues resume QUEUE
  hipq dead-letters list [--source intake|reply|callback] [--limit N] [--cursor C]
  hipq dead-letters replay ID
  hipq dead-letters replay --reason WHY [--source S] [--reason-prefix P] [--since T]
      [--until T] [--dry-run] [--no-wait]
  hipq operations get|stop ID
`

// defaultServer is where the API listens unless configured otherwise.
const defaultServer = "http://127.0.0.1:8080"

// remote is one CLI call to the API.
type remote struct {
	server, token string
	// caFile holds the CA certificates that sign the API's (https with a
	// private CA); empty: the system's roots.
	caFile string
	json   bool
	out    io.Writer
	client *http.Client
}

// remoteFlags adds the flags every API command takes.
func remoteFlags(fs *flag.FlagSet) *remote {
	r := &remote{client: &http.Client{Timeout: 30 * time.Second}}
	server := os.Getenv("HIPQ_API_URL")
	if server == "" {
		server = defaultServer
	}
	fs.StringVar(&r.server, "server", server, "API base URL (or $HIPQ_API_URL)")
	fs.StringVar(&r.token, "token", os.Getenv("HIPQ_API_TOKEN"), "bearer token (or $HIPQ_API_TOKEN)")
	fs.StringVar(&r.caFile, "ca-file", os.Getenv("HIPQ_API_CA_FILE"),
		"PEM file of the CA that signed the API's certificate, for https with a private CA (or $HIPQ_API_CA_FILE)")
	fs.BoolVar(&r.json, "json", false, "print the API's JSON")
	return r
}

// parseArgs parses flags placed anywhere among the arguments and returns
// the positional ones, which must number want (any number when want < 0).
func parseArgs(fs *flag.FlagSet, args []string, want int, names string) ([]string, error) {
	fs.SetOutput(io.Discard)
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			var flags strings.Builder
			fs.SetOutput(&flags)
			fs.PrintDefaults()
			return nil, &exitError{2, fmt.Errorf("%s: %w\nflags:\n%s", fs.Name(), err, flags.String())}
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos, args = append(pos, args[0]), args[1:]
	}
	if want >= 0 && len(pos) != want {
		return nil, &exitError{2, fmt.Errorf("%s: want %s, got %d argument(s)", fs.Name(), names, len(pos))}
	}
	return pos, nil
}

// apiError is an error answer of the API.
type apiError struct {
	Status  int
	Code    string
	Message string
}

func (e *apiError) Error() string {
	return fmt.Sprintf("%d %s: %s", e.Status, e.Code, e.Message)
}

// call makes one API request, with body as JSON when not nil, and decodes
// a 2xx answer into out (when not nil); the raw answer is returned for
// --json.
func (r *remote) call(method, path string, query url.Values, body, out any) ([]byte, error) {
	u := strings.TrimRight(r.server, "/") + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	var in io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		in = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, u, in)
	if err != nil {
		return nil, &exitError{2, fmt.Errorf("--server %q: %w", r.server, err)}
	}
	if r.token != "" {
		req.Header.Set("Authorization", "Bearer "+r.token)
	}
	if r.caFile != "" && r.client.Transport == nil {
		pool, err := tlsconf.Pool(r.caFile)
		if err != nil {
			return nil, &exitError{2, fmt.Errorf("--ca-file: %w", err)}
		}
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
		r.client.Transport = tr
	}
	resp, err := r.client.Do(req)
	var unverified *tls.CertificateVerificationError
	if errors.As(err, &unverified) {
		return nil, fmt.Errorf("cannot trust the hipq API at %s: %w (--ca-file or $HIPQ_API_CA_FILE names the CA that signed its certificate)", r.server, err)
	}
	if err != nil {
		return nil, fmt.Errorf("cannot reach the hipq API at %s (set --server or $HIPQ_API_URL): %w", r.server, err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("%s %s: reading the answer: %w", method, path, err)
	}
	if resp.StatusCode >= 300 {
		var e struct {
			Error struct{ Code, Message string }
		}
		if json.Unmarshal(answer, &e) != nil || e.Error.Code == "" {
			return nil, &apiError{Status: resp.StatusCode, Code: "http", Message: strings.TrimSpace(string(answer))}
		}
		return nil, &apiError{Status: resp.StatusCode, Code: e.Error.Code, Message: e.Error.Message}
	}
	if out != nil {
		if err := json.Unmarshal(answer, out); err != nil {
			return nil, fmt.Errorf("%s %s: the answer is not what hipq sends (is --server a hipq API?): %w", method, path, err)
		}
	}
	return answer, nil
}

// do calls the API; with --json it prints the answer. done says the
// command has nothing left to print (an error, or --json).
func (r *remote) do(method, path string, query url.Values, out any) (done bool, err error) {
	raw, err := r.call(method, path, query, nil, out)
	if err != nil {
		return true, err
	}
	if r.json {
		return true, r.printJSON(raw)
	}
	return false, nil
}

// listQuery is a list call's query: limit plus the filters that are set.
func listQuery(limit int, filters map[string]string) url.Values {
	q := url.Values{"limit": {strconv.Itoa(limit)}}
	for k, v := range filters {
		if v != "" {
			q.Set(k, v)
		}
	}
	return q
}

// more tells how to get the next page, if any.
func more(w io.Writer, next *string) {
	if next != nil {
		fmt.Fprintf(w, "more: add --cursor %s\n", *next)
	}
}

// printJSON prints an API answer indented.
func (r *remote) printJSON(raw []byte) error {
	var b bytes.Buffer
	if err := json.Indent(&b, raw, "", "  "); err != nil {
		return err
	}
	b.WriteByte('\n')
	_, err := r.out.Write(b.Bytes())
	return err
}

func jobPath(typ, key string, suffix string) string {
	return "/v1/jobs/" + url.PathEscape(typ) + "/" + url.PathEscape(key) + suffix
}

func cmdJobs(args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return &exitError{2, errors.New("jobs: want get, list, cancel, replay or run-now\n\n" + remoteUsage)} //nolint:staticcheck // ST1005: the message is the usage text, printed as it is
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("jobs "+sub, flag.ContinueOnError)
	r := remoteFlags(fs)
	r.out = stdout
	switch sub {
	case "get":
		pos, err := parseArgs(fs, args, 2, "TYPE KEY")
		if err != nil {
			return err
		}
		var out struct {
			Job      api.Job         `json:"job"`
			Attempts []store.Attempt `json:"attempts"`
		}
		if done, err := r.do(http.MethodGet, jobPath(pos[0], pos[1], ""), nil, &out); done {
			return err
		}
		return printJob(stdout, &out.Job, out.Attempts)
	case "list":
		typ := fs.String("type", "", "only jobs of this job type")
		state := fs.String("state", "", "only jobs in this state (initial, running, error, retry, final)")
		queue := fs.String("queue", "", "only jobs of this queue")
		limit := fs.Int("limit", 50, "jobs per page")
		cursor := fs.String("cursor", "", "the next_cursor of the previous page")
		if _, err := parseArgs(fs, args, 0, "no argument"); err != nil {
			return err
		}
		q := listQuery(*limit, map[string]string{"job_type": *typ, "state": *state, "queue": *queue, "cursor": *cursor})
		var out struct {
			Jobs []api.Job `json:"jobs"`
			Next *string   `json:"next_cursor"`
		}
		if done, err := r.do(http.MethodGet, "/v1/jobs", q, &out); done {
			return err
		}
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tTYPE\tKEY\tQUEUE\tSTATE\tOUTCOME\tATTEMPT\tSCHEDULED\tUPDATED")
		for _, j := range out.Jobs {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%d/%d\t%s\t%s\n", j.ID, j.JobType, j.JobKey, j.Queue, j.State, deref(j.Outcome),
				j.Attempt, j.MaxAttempts, stamp(&j.ScheduledRunTime), stamp(&j.UpdateTime))
		}
		err := tw.Flush()
		more(stdout, out.Next)
		return err
	case "cancel", "replay", "run-now":
		b := jobFilterFlags(fs)
		pos, err := parseArgs(fs, args, -1, "")
		if err != nil {
			return err
		}
		if len(pos) == 0 {
			return r.bulk(b, "/v1/jobs/"+sub)
		}
		if len(pos) != 2 || sub == "run-now" || b.set(fs) {
			return &exitError{2, fmt.Errorf("jobs %s: want TYPE KEY for one job, or filter flags (and no argument) for every job they match", sub)}
		}
		var out struct {
			Job api.Job `json:"job"`
		}
		if done, err := r.do(http.MethodPost, jobPath(pos[0], pos[1], "/"+sub), nil, &out); done {
			return err
		}
		verb := "cancelled"
		if sub == "replay" {
			verb = "replayed as a new job"
		}
		fmt.Fprintf(stdout, "%s/%s %s: job %d, %s\n", out.Job.JobType, out.Job.JobKey, verb, out.Job.ID, jobState(&out.Job))
		return nil
	}
	return &exitError{2, fmt.Errorf("jobs: unknown subcommand %q (get, list, cancel, replay, run-now)", sub)}
}

func cmdQueues(args []string, stdout io.Writer) error {
	if len(args) == 0 || (args[0] != "pause" && args[0] != "resume") {
		return &exitError{2, errors.New("queues: want pause QUEUE or resume QUEUE")}
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("queues "+sub, flag.ContinueOnError)
	r := remoteFlags(fs)
	r.out = stdout
	pos, err := parseArgs(fs, args, 1, "QUEUE")
	if err != nil {
		return err
	}
	var out struct {
		Queue  string `json:"queue"`
		Paused bool   `json:"paused"`
	}
	if done, err := r.do(http.MethodPost, "/v1/queues/"+url.PathEscape(pos[0])+"/"+sub, nil, &out); done {
		return err
	}
	state := "resumed: dispatchers claim from it again"
	if out.Paused {
		state = "paused: no instance claims from it from its next round"
	}
	fmt.Fprintf(stdout, "queue %s %s\n", out.Queue, state)
	return nil
}

func cmdDeadLetters(args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return &exitError{2, errors.New("dead-letters: want list or replay ID")}
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("dead-letters "+sub, flag.ContinueOnError)
	r := remoteFlags(fs)
	r.out = stdout
	switch sub {
	case "list":
		source := fs.String("source", "", "only dead letters from intake, outbox, reply or callback")
		limit := fs.Int("limit", 50, "dead letters per page")
		cursor := fs.String("cursor", "", "the next_cursor of the previous page")
		if _, err := parseArgs(fs, args, 0, "no argument"); err != nil {
			return err
		}
		q := listQuery(*limit, map[string]string{"source": *source, "cursor": *cursor})
		var out struct {
			DeadLetters []api.DeadLetter `json:"dead_letters"`
			Next        *string          `json:"next_cursor"`
		}
		if done, err := r.do(http.MethodGet, "/v1/dead-letters", q, &out); done {
			return err
		}
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tSOURCE\tFROM\tRECEIVED\tREPLAYED\tREASON")
		for _, d := range out.DeadLetters {
			from := "http"
			if d.Topic != "" {
				from = fmt.Sprintf("%s/%d@%d", d.Topic, d.Partition, d.Offset)
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\n", d.ID, d.Source, from, stamp(&d.ReceivedAt), stamp(d.ReplayedAt), oneLine(d.Reason, 100))
		}
		err := tw.Flush()
		more(stdout, out.Next)
		return err
	case "replay":
		b := deadLetterFilterFlags(fs)
		pos, err := parseArgs(fs, args, -1, "")
		if err != nil {
			return err
		}
		if len(pos) == 0 {
			return r.bulk(b, "/v1/dead-letters/replay")
		}
		if len(pos) != 1 || b.set(fs) {
			return &exitError{2, errors.New("dead-letters replay: want ID for one dead letter, or filter flags (and no argument) for every one they match")}
		}
		id, err := strconv.ParseInt(pos[0], 10, 64)
		if err != nil || id < 1 {
			return &exitError{2, fmt.Errorf("dead-letters replay: %q is not a dead letter id", pos[0])}
		}
		var out api.DeadLetterReplay
		if done, err := r.do(http.MethodPost, fmt.Sprintf("/v1/dead-letters/%d/replay", id), nil, &out); done {
			return err
		}
		fmt.Fprintf(stdout, "dead letter %d (%s) replayed: %s", out.ID, out.Source, out.Result)
		if out.Job != nil {
			fmt.Fprintf(stdout, " (job %d %s/%s, %s)", out.Job.ID, out.Job.JobType, out.Job.JobKey, jobState(out.Job))
		}
		fmt.Fprintln(stdout)
		return nil
	}
	return &exitError{2, fmt.Errorf("dead-letters: unknown subcommand %q (list, replay)", sub)}
}

// printJob prints a job's columns, then its attempts as a table.
func printJob(w io.Writer, j *api.Job, attempts []store.Attempt) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	row("id", strconv.FormatInt(j.ID, 10))
	row("job", j.JobType+"/"+j.JobKey)
	row("queue", j.Queue)
	row("state", jobState(j))
	row("error", j.Error)
	row("attempt", fmt.Sprintf("%d of %d", j.Attempt, j.MaxAttempts))
	row("scheduled", stamp(&j.ScheduledRunTime))
	row("priority", strconv.Itoa(j.Priority))
	row("started", stamp(j.StartedAt))
	row("expires", stamp(j.ExpiresAt))
	row("job_data", oneLine(string(j.JobData), 200))
	if res := string(j.Result); res != "null" {
		row("result", oneLine(res, 200))
	}
	row("created", stamp(&j.CreatedAt))
	row("updated", stamp(&j.UpdateTime))
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(attempts) == 0 {
		fmt.Fprintln(w, "\nno attempts yet")
		return nil
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ATTEMPT\tOUTCOME\tINSTANCE\tDISPATCHED\tSENT\tREPLIED\tERROR")
	for _, a := range attempts {
		outcome := deref(a.Outcome)
		if outcome == "-" {
			outcome = "(in flight)"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", a.Attempt, outcome, a.Instance, stamp(&a.DispatchedAt),
			stamp(a.SentAt), stamp(a.RepliedAt), oneLine(deref(a.Error), 80))
	}
	return tw.Flush()
}

func jobState(j *api.Job) string {
	if j.Outcome != nil {
		return j.State + " / " + *j.Outcome
	}
	return j.State
}

func deref(s *string) string {
	if s == nil || *s == "" {
		return "-"
	}
	return *s
}

func stamp(t *time.Time) string {
	if t == nil || t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// oneLine keeps a value on one table line, cut at max runes.
func oneLine(s string, max int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > max {
		return string(r[:max-1]) + "…"
	}
	if s == "" {
		return "-"
	}
	return s
}

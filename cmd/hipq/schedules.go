package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"text/tabwriter"
	"time"
)

type scheduleOut struct {
	Name       string     `json:"name"`
	Cron       string     `json:"cron"`
	TZ         string     `json:"tz"`
	JobType    string     `json:"job_type"`
	Paused     bool       `json:"paused"`
	LastFire   *time.Time `json:"last_fire"`
	NextFire   *time.Time `json:"next_fire"`
	LastJobKey string     `json:"last_job_key"`
}

// cmdSchedules: list, pause, resume and trigger over the API; next reads
// the config alone.
func cmdSchedules(args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return &exitError{2, errors.New("schedules: want list, next NAME, pause NAME, resume NAME or trigger NAME")}
	}
	sub, args := args[0], args[1:]
	if sub == "next" {
		return cmdSchedulesNext(args, stdout)
	}
	fs := flag.NewFlagSet("schedules "+sub, flag.ContinueOnError)
	r := remoteFlags(fs)
	r.out = stdout
	switch sub {
	case "list":
		if _, err := parseArgs(fs, args, 0, "no argument"); err != nil {
			return err
		}
		var out struct{ Schedules []scheduleOut }
		if done, err := r.do(http.MethodGet, "/v1/schedules", nil, &out); done {
			return err
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tCRON\tTZ\tJOB TYPE\tSTATE\tLAST FIRE\tNEXT FIRE\tLAST JOB KEY")
		for _, s := range out.Schedules {
			state := "active"
			if s.Paused {
				state = "paused"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Name, s.Cron, s.TZ, s.JobType, state, stamp(s.LastFire), stamp(s.NextFire), s.LastJobKey)
		}
		return tw.Flush()
	case "pause", "resume", "trigger":
		pos, err := parseArgs(fs, args, 1, "NAME")
		if err != nil {
			return err
		}
		var out struct {
			Paused  bool   `json:"paused"`
			JobKey  string `json:"job_key"`
			Created bool   `json:"created"`
		}
		if done, err := r.do(http.MethodPost, "/v1/schedules/"+url.PathEscape(pos[0])+"/"+sub, nil, &out); done {
			return err
		}
		switch {
		case sub == "trigger" && out.Created:
			fmt.Fprintf(stdout, "schedule %s triggered: job %s enqueued\n", pos[0], out.JobKey)
		case sub == "trigger":
			fmt.Fprintf(stdout, "schedule %s triggered: a job with key %s is already waiting or running\n", pos[0], out.JobKey)
		case out.Paused:
			fmt.Fprintf(stdout, "schedule %s paused: its ticks pass without a job until resumed\n", pos[0])
		default:
			fmt.Fprintf(stdout, "schedule %s resumed from now: ticks missed while paused do not fire\n", pos[0])
		}
		return nil
	}
	return &exitError{2, fmt.Errorf("schedules: unknown subcommand %q (list, next, pause, resume, trigger)", sub)}
}

// cmdSchedulesNext prints a schedule's next ticks from the config alone:
// one RFC 3339 time per line, in the schedule's zone.
func cmdSchedulesNext(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("schedules next", flag.ContinueOnError)
	cfgPath := configFlag(fs)
	from := fs.String("from", "", "RFC 3339 time to start after (default: now)")
	count := fs.Int("count", 5, "how many ticks")
	pos, err := parseArgs(fs, args, 1, "NAME")
	if err != nil {
		return err
	}
	if *count < 1 || *count > 10000 {
		return &exitError{2, fmt.Errorf("schedules next: --count %d must be between 1 and 10000", *count)}
	}
	t := time.Now()
	if *from != "" {
		if t, err = time.Parse(time.RFC3339, *from); err != nil {
			return &exitError{2, fmt.Errorf("schedules next: --from %q is not an RFC 3339 time", *from)}
		}
	}
	cfg, err := loadConfig(*cfgPath)
	if err != nil {
		return err
	}
	var names []string
	for _, s := range cfg.PeriodicJobs() {
		names = append(names, s.Name)
		if s.Name != pos[0] {
			continue
		}
		for range *count {
			if t = s.Next(t); t.IsZero() {
				break
			}
			fmt.Fprintln(stdout, t.In(s.Zone).Format(time.RFC3339))
		}
		return nil
	}
	return &exitError{2, fmt.Errorf("schedules next: no schedule %q in the config (schedules: %s)", pos[0], strings.Join(names, ", "))}
}

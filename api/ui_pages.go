package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

// queueRow is one queue on the overview.
type queueRow struct {
	Name     string
	Paused   bool
	Counts   map[string]int64 // non-final jobs by state
	Running  int64            // running weight (non-critical and critical alike)
	Limit    int              // throttle_limit; 0 = none
	Shares   []shareRow
	Activity chart
	Sent     int64 // last hour
	Replied  int64
}

type shareRow struct {
	Name    string
	Running int64
	Cap     int // 0 = bounded by the queue only
}

// chart is a queue's sends and replies per minute over the last hour, as
// SVG polyline points (drawn server-side: no script needed).
type chart struct {
	Sent, Replied string
	Max           int64
}

const chartW, chartH = 360, 60

type overviewData struct {
	Queues      []queueRow
	States      []string
	FinalEst    int64
	DeadLetters map[string]int64
	DeadTotal   int64
	Lag         []GroupLag
	LagErr      string
	Now         time.Time
	// Events: outcome events are configured or some wait; Pending counts
	// those waiting to be relayed, by topic.
	Events  bool
	Pending []topicCount
}

type topicCount struct {
	Topic string
	N     int64
}

// overview: per queue, jobs by state (non-final only: final rows are an
// estimate), running weight against the throttle, pause, the last hour's
// sends and replies per minute; dead letters of the last 24 h; lag.
func (u *ui) overview(r *http.Request, v *view) error {
	v.Page, v.Title, v.Live = "overview", "Overview", true
	ctx := r.Context()
	counts, err := u.counts.get(ctx, u.s.st.QueueCounts)
	if err != nil {
		return err
	}
	paused, err := u.s.st.QueuesPaused(ctx)
	if err != nil {
		return err
	}
	now := time.Now()
	acts, err := u.s.st.ActivitySince(ctx, now.Add(-time.Hour))
	if err != nil {
		return err
	}
	dls, err := u.s.st.DeadLettersSince(ctx, now.Add(-24*time.Hour))
	if err != nil {
		return err
	}
	d := &overviewData{States: []string{"initial", "retry", "running"}, DeadLetters: dls, Now: now}
	for _, n := range dls {
		d.DeadTotal += n
	}
	names := slices.Clone(u.s.cfg.Queues)
	for _, c := range counts {
		if !slices.Contains(names, c.Queue) {
			names = append(names, c.Queue)
		}
	}
	var nonFinal int64
	for _, name := range names {
		q := queueRow{Name: name, Paused: paused[name], Counts: map[string]int64{}}
		for _, c := range counts {
			if c.Queue == name {
				q.Counts[c.State] = c.N
				nonFinal += c.N
				if c.State == string(correlator.StateRunning) {
					q.Running = c.Weight
				}
			}
		}
		if th := u.cfg.Throttles[name]; th != nil {
			q.Limit = max(th.Limit, 0)
			if sh := th.Shares; sh != nil {
				weights, err := u.s.st.RunningWeights(ctx, name, sh.Path)
				if err != nil {
					return err
				}
				for k, c := range sh.Caps {
					q.Shares = append(q.Shares, shareRow{Name: k, Running: weights[k], Cap: c})
				}
				sort.Slice(q.Shares, func(i, j int) bool { return q.Shares[i].Name < q.Shares[j].Name })
				var other int64
				for k, w := range weights {
					if _, ok := sh.Caps[k]; !ok {
						other += w
					}
				}
				q.Shares = append(q.Shares, shareRow{Name: correlator.OtherPartition, Running: other, Cap: sh.OtherCap})
			}
		}
		q.Activity, q.Sent, q.Replied = plot(acts, name, now)
		d.Queues = append(d.Queues, q)
	}
	if d.FinalEst, err = u.s.st.FinalEstimate(ctx, nonFinal); err != nil {
		return err
	}
	pending, err := u.s.st.EventsPending(ctx)
	if err != nil {
		return err
	}
	for _, t := range slices.Sorted(maps.Keys(pending)) {
		d.Pending = append(d.Pending, topicCount{Topic: t, N: pending[t]})
	}
	ev := store.EventsOf(u.s.cfg.Types)
	d.Events = len(d.Pending) > 0 || ev.On()
	if u.cfg.Lag != nil {
		// Kafka down must not hold the page: the lag is left out instead.
		lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		d.Lag, err = u.cfg.Lag(lctx)
		cancel()
		if err != nil {
			d.LagErr = correlator.Clip(err.Error(), 300)
		}
	}
	v.Data = d
	return nil
}

// plot turns a queue's minutes into polyline points, the newest minute at
// the right.
func plot(acts []store.Activity, queue string, now time.Time) (chart, int64, int64) {
	var sent, replied [60]int64
	var top, sumS, sumR int64
	end := now.Truncate(time.Minute)
	for _, a := range acts {
		i := 59 - int(end.Sub(a.Minute)/time.Minute)
		if a.Queue != queue || i < 0 || i > 59 {
			continue
		}
		sent[i], replied[i] = a.Dispatched, a.Replied
		top = max(top, a.Dispatched, a.Replied)
		sumS += a.Dispatched
		sumR += a.Replied
	}
	pts := func(xs [60]int64) string {
		var b []byte
		for i, x := range xs {
			y := chartH - int(x*(chartH-4)/max(top, 1)) - 2
			b = fmt.Appendf(b, "%d,%d ", i*chartW/59, y)
		}
		return string(b)
	}
	return chart{Sent: pts(sent), Replied: pts(replied), Max: top}, sumS, sumR
}

type jobsData struct {
	Queue, Type, State, KeyPrefix string
	Queues, Types, States         []string
	Jobs                          []*correlator.Job
	Next                          any // the keyset cursor of the next page, nil on the last
	// Matching is how many jobs the filter matches, for the bulk actions
	// (admin only); "" without a filter.
	Matching string
}

// jobs: the job list, filtered by queue, type, state and key prefix,
// newest first, a keyset page at a time.
func (u *ui) jobs(r *http.Request, v *view) error {
	v.Page, v.Title = "jobs", "Jobs"
	q := r.URL.Query()
	d := &jobsData{Queue: q.Get("queue"), Type: q.Get("job_type"), State: q.Get("state"), KeyPrefix: q.Get("key_prefix"),
		Queues: u.s.cfg.Queues, States: []string{"initial", "retry", "running", "final"}}
	for name := range u.s.cfg.Types {
		d.Types = append(d.Types, name)
	}
	slices.Sort(d.Types)
	v.Data = d
	if d.State != "" && !slices.Contains(d.States, d.State) {
		return errorf(http.StatusBadRequest, "invalid_parameter", "state: %q is not one of initial, retry, running, final", d.State)
	}
	if d.Queue != "" && !slices.Contains(u.s.cfg.Queues, d.Queue) {
		// (a queue's filter reads the index of its configured types; an
		// unknown one would walk the table)
		return errorf(http.StatusBadRequest, "invalid_parameter", "queue: %q is not a configured queue", correlator.Clip(d.Queue, 64))
	}
	for name, val := range map[string]string{"queue": d.Queue, "job_type": d.Type, "key_prefix": d.KeyPrefix} {
		if len(val) > correlator.MaxJobKeyBytes || !utf8.ValidString(val) {
			return errorf(http.StatusBadRequest, "invalid_parameter", "%s: too long or not UTF-8", name)
		}
	}
	before, _ := strconv.ParseInt(q.Get("before"), 10, 64)
	const limit = 50
	jobs, err := u.s.st.JobList(r.Context(), store.JobListParams{JobType: d.Type, State: correlator.State(d.State),
		Queue: d.Queue, QueueTypes: u.s.queueTypes(d.Queue), KeyPrefix: d.KeyPrefix, BeforeID: max(before, 0), Limit: limit + 1})
	if err != nil {
		return err
	}
	d.Jobs, d.Next = page(jobs, limit, func(j *correlator.Job) int64 { return j.ID })
	if d.Queue != "" || d.Type != "" || d.State != "" || d.KeyPrefix != "" {
		d.Matching, err = u.listCount(r, v, store.Operation{Jobs: &store.JobFilter{Queue: d.Queue, JobType: d.Type,
			State: correlator.State(d.State), KeyPrefix: d.KeyPrefix}})
	}
	return err
}

type jobData struct {
	Job      *correlator.Job
	Data     string
	Result   string
	Attempts []attemptRow
	Shape    RequestShape
	Headers  [][2]string
	Back     string
}

type attemptRow struct {
	store.Attempt
	Reply, Progress string
}

// job: one job (by type and key: the non-final one, else the latest; or
// by id), every attempt, the request headers hipq sent, and the cancel
// and replay buttons.
func (u *ui) job(r *http.Request, v *view) error {
	v.Page, v.Title = "job", "Job"
	q := r.URL.Query()
	var j *correlator.Job
	var err error
	if id, _ := strconv.ParseInt(q.Get("id"), 10, 64); id > 0 {
		j, err = u.s.st.JobGetByID(r.Context(), id)
	} else {
		j, err = u.s.st.JobGet(r.Context(), q.Get("job_type"), q.Get("job_key"))
	}
	if errors.Is(err, correlator.ErrNotFound) {
		return errorf(http.StatusNotFound, "not_found", "no such job")
	}
	if err != nil {
		return err
	}
	attempts, err := u.s.st.AttemptList(r.Context(), j.ID)
	if err != nil {
		return err
	}
	d := &jobData{Job: j, Data: pretty(u.redact(j.JobData)), Result: pretty(j.Result),
		Back: u.link("job", "id", j.ID)}
	for i := len(attempts) - 1; i >= 0; i-- {
		a := attempts[i]
		d.Attempts = append(d.Attempts, attemptRow{Attempt: a, Reply: pretty(a.Reply), Progress: pretty(a.Progress)})
	}
	d.Shape, d.Headers = u.requestHeaders(j)
	v.Title = "Job " + strconv.FormatInt(j.ID, 10)
	v.Data = d
	return nil
}

// requestHeaders are the headers hipq sends with the job's latest
// attempt: its own, and the names of the type's configured ones.
func (u *ui) requestHeaders(j *correlator.Job) (RequestShape, [][2]string) {
	shape := u.cfg.Requests[j.JobType]
	id, attempt := strconv.FormatInt(j.ID, 10), strconv.Itoa(j.Attempt)
	var h [][2]string
	if shape.Transport == "http" {
		h = append(h, [2]string{"Content-Type", "application/json"}, [2]string{"User-Agent", "hipq"})
		for _, name := range shape.Headers {
			h = append(h, [2]string{name, "(configured)"})
		}
		h = append(h, [2]string{"Hipq-Job-Type", j.JobType}, [2]string{"Hipq-Job-Key", j.JobKey},
			[2]string{"Hipq-Attempt", attempt}, [2]string{"Hipq-Job-Id", id},
			[2]string{"Hipq-Callback-Url", "(signed for this attempt)"}, [2]string{"Hipq-Heartbeat-Url", "(signed for this attempt)"})
	} else {
		h = append(h, [2]string{correlator.HeaderJobType, j.JobType}, [2]string{correlator.HeaderJobKey, j.JobKey},
			[2]string{correlator.HeaderAttempt, attempt}, [2]string{correlator.HeaderJobID, id})
		if shape.ReplyTopic != "" {
			h = append(h, [2]string{correlator.HeaderReplyTo, shape.ReplyTopic})
		}
	}
	if j.Trace.Parent != "" {
		h = append(h, [2]string{correlator.HeaderTraceParent, j.Trace.Parent})
	}
	if j.Trace.State != "" {
		h = append(h, [2]string{correlator.HeaderTraceState, j.Trace.State})
	}
	return shape, h
}

type deadLetterRow struct {
	store.DeadLetter
	Key, Value string
	Headers    [][2]string
}

type deadLettersData struct {
	Source  string
	Sources []string
	Letters []deadLetterRow
	Next    any // as jobsData.Next
	Back    string
	// Matching is how many dead letters of the source are not replayed
	// yet, for the bulk replay (admin only); "" without a source.
	Matching string
}

// deadLetters: newest first, by source, with the decoded record, its
// headers and a replay button.
func (u *ui) deadLetters(r *http.Request, v *view) error {
	v.Page, v.Title = "deadletters", "Dead letters"
	q := r.URL.Query()
	d := &deadLettersData{Source: q.Get("source"),
		Sources: []string{store.SourceIntake, store.SourceOutbox, store.SourceReply, store.SourceCallback}}
	v.Data = d
	if d.Source != "" && !slices.Contains(d.Sources, d.Source) {
		return errorf(http.StatusBadRequest, "invalid_parameter", "source: %q is not one of intake, outbox, reply, callback", correlator.Clip(d.Source, 64))
	}
	before, _ := strconv.ParseInt(q.Get("before"), 10, 64)
	const limit = 50
	dls, err := u.s.st.DeadLetterList(r.Context(), store.DeadLetterListParams{Kind: d.Source, AfterID: max(before, 0), Limit: limit + 1})
	if err != nil {
		return err
	}
	dls, d.Next = page(dls, limit, func(d store.DeadLetter) int64 { return d.ID })
	d.Back = u.link("dead-letters", "source", d.Source, "before", before)
	for _, dl := range dls {
		row := deadLetterRow{DeadLetter: dl, Key: text(dl.Source.Key), Value: pretty(u.redactRecord(dl.Source.Value))}
		for _, h := range dl.Source.Headers {
			row.Headers = append(row.Headers, [2]string{h.Key, text(h.Value)})
		}
		d.Letters = append(d.Letters, row)
	}
	if d.Source != "" {
		d.Matching, err = u.listCount(r, v, store.Operation{Kind: store.OperationDeadLetterReplay,
			DeadLetters: &store.DeadLetterFilter{Source: d.Source}})
	}
	return err
}

// redactRecord is a dead letter's record value as the dashboard shows
// it. With redaction configured it fails closed: a value that is exactly
// one JSON object is shown re-encoded from what was parsed, each member
// whose key is job_data in any case redacted (the decoder unescapes keys,
// and a duplicate member is shown redacted too, not only the one a
// decoder keeps); anything else (an outbox row cut at max_bytes+1, data
// trailing the object, several records, not JSON) is hidden, since where
// its job_data lies cannot be known.
func (u *ui) redactRecord(b []byte) []byte {
	if len(u.cfg.Redact) == 0 {
		return b
	}
	members, ok := objectMembers(b)
	if !ok {
		return fmt.Appendf(nil, "[hidden: %d bytes that are not one JSON object; api.ui.redact is set, "+
			"and where their job_data lies cannot be known]", len(b))
	}
	out := []byte{'{'}
	for i, m := range members {
		if i > 0 {
			out = append(out, ',')
		}
		key, err := json.Marshal(m.key)
		if err != nil {
			return []byte(`"` + redacted + `"`)
		}
		out = append(append(out, key...), ':')
		if strings.EqualFold(m.key, "job_data") {
			out = append(out, u.redact(m.value)...)
		} else {
			out = append(out, m.value...)
		}
	}
	return append(out, '}')
}

type member struct {
	key   string
	value json.RawMessage
}

// objectMembers reads b as exactly one JSON object: its members in order,
// duplicates kept, keys unescaped; ok is false for anything else.
func objectMembers(b []byte) (members []member, ok bool) {
	d := json.NewDecoder(bytes.NewReader(b))
	if tok, err := d.Token(); err != nil || tok != json.Delim('{') {
		return nil, false
	}
	for d.More() {
		tok, err := d.Token()
		key, isKey := tok.(string)
		if err != nil || !isKey {
			return nil, false
		}
		var v json.RawMessage
		if d.Decode(&v) != nil {
			return nil, false
		}
		members = append(members, member{key, v})
	}
	if tok, err := d.Token(); err != nil || tok != json.Delim('}') {
		return nil, false
	}
	if _, err := d.Token(); err != io.EOF {
		return nil, false
	}
	return members, true
}

// text shows bytes as text when they are UTF-8, else as a Go quoted string.
func text(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	return strconv.Quote(string(b))
}

type queuesData struct {
	Queues []queueConf
}

type queueConf struct {
	Name     string
	Paused   bool
	Throttle *correlator.Throttle
	Types    []string
}

// queues: each queue's limits and types, and pause or resume.
func (u *ui) queues(r *http.Request, v *view) error {
	v.Page, v.Title = "queues", "Queues"
	paused, err := u.s.st.QueuesPaused(r.Context())
	if err != nil {
		return err
	}
	d := &queuesData{}
	for _, name := range u.s.cfg.Queues {
		d.Queues = append(d.Queues, queueConf{Name: name, Paused: paused[name], Throttle: u.cfg.Throttles[name],
			Types: u.s.queueTypes(name)})
	}
	v.Data = d
	return nil
}

// schedules: the periodic jobs, their last and next fire, and pause,
// resume and trigger.
func (u *ui) schedules(r *http.Request, v *view) error {
	v.Page, v.Title = "schedules", "Schedules"
	out, err := u.s.scheduleList(r.Context())
	v.Data = out
	return err
}

// countCache keeps the non-final counts for a few seconds: every open
// overview refreshes every 5 s, and a count walks every waiting job.
type countCache struct {
	mu  sync.Mutex
	at  time.Time
	val []store.QueueCount
}

const countCacheAge = 3 * time.Second

func (c *countCache) get(ctx context.Context, count func(context.Context) ([]store.QueueCount, error)) ([]store.QueueCount, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && time.Since(c.at) < countCacheAge {
		return c.val, nil
	}
	v, err := count(ctx)
	if err != nil {
		return nil, err
	}
	c.val, c.at = v, time.Now()
	return v, nil
}

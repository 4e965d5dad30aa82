package api

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"go.opentelemetry.io/otel/trace"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
)

// Job is a job as the API shows it: the columns of hipq_job.
type Job struct {
	ID               int64                   `json:"id"`
	Queue            string                  `json:"queue"`
	JobType          string                  `json:"job_type"`
	JobKey           string                  `json:"job_key"`
	JobData          json.RawMessage         `json:"job_data"`
	State            string                  `json:"state"`
	Outcome          *string                 `json:"outcome"`
	Error            string                  `json:"error"`
	Attempt          int                     `json:"attempt"`
	MaxAttempts      int                     `json:"max_attempts"`
	ScheduledRunTime time.Time               `json:"scheduled_run_time"`
	Priority         int                     `json:"priority"`
	ThrottleFactor   int                     `json:"throttle_factor"`
	TimeWindows      []correlator.TimeWindow `json:"time_windows"`
	TimeoutSeconds   int                     `json:"timeout_seconds"`
	ExpiresAt        *time.Time              `json:"expires_at"`
	StartedAt        *time.Time              `json:"started_at"`
	Result           json.RawMessage         `json:"result"`
	CreatedAt        time.Time               `json:"created_at"`
	UpdateTime       time.Time               `json:"update_time"`
}

func jobJSON(j *correlator.Job) *Job {
	out := &Job{ID: j.ID, Queue: j.Queue, JobType: j.JobType, JobKey: j.JobKey, JobData: j.JobData, State: string(j.State),
		Error: j.Error, Attempt: j.Attempt, MaxAttempts: j.MaxAttempts, ScheduledRunTime: j.ScheduledRunTime,
		Priority: j.Priority, ThrottleFactor: j.ThrottleFactor, TimeWindows: j.TimeWindows, TimeoutSeconds: j.TimeoutSeconds,
		ExpiresAt: j.ExpiresAt, StartedAt: j.StartedAt, Result: j.Result, CreatedAt: j.CreatedAt, UpdateTime: j.UpdateTime}
	if j.Outcome != "" {
		o := string(j.Outcome)
		out.Outcome = &o
	}
	if len(out.Result) == 0 {
		out.Result = json.RawMessage("null")
	}
	return out
}

func (s *Server) jobType(name string) (*correlator.JobType, error) {
	jt := s.cfg.Types[name]
	if jt == nil {
		return nil, errorf(http.StatusNotFound, correlator.CodeUnknownJobType, "job type %q is not configured", name)
	}
	return jt, nil
}

// enqueue: PUT /v1/jobs/{job_type}/{job_key}. 201 new; 200 when a
// non-final job with the same job_data exists; 409 when one has other data.
func (s *Server) enqueue(w http.ResponseWriter, r *http.Request) error {
	jobType, jobKey := r.PathValue("job_type"), r.PathValue("job_key")
	jt, err := s.jobType(jobType)
	if err != nil {
		return err
	}
	body, err := s.readBody(w, r)
	if err != nil {
		return err
	}
	req, replyTo, err := decodeEnqueueTo(body, jobType, jobKey, s.cfg.MaxBodyBytes)
	if err != nil {
		return inputError(err)
	}
	j, err := correlator.NewJob(req, jt, time.Now())
	if err != nil {
		return inputError(err)
	}
	if err := j.TakeHeaders(correlationOf(r), jt); err != nil {
		return inputError(err)
	}
	j.Trace = traceOf(r)
	j.ReplyTo = replyTo
	if err := jt.CheckReplyTo(replyTo); err != nil {
		return inputError(err)
	}
	cur, created, err := s.st.JobEnqueue(r.Context(), j)
	count := func(result string) { s.cfg.Metrics.IntakeRecords.WithLabelValues(metrics.SourceAPI, result).Inc() }
	switch {
	case errors.Is(err, store.ErrConflict):
		count("conflict")
		return errorf(http.StatusConflict, correlator.CodeConflict, "job %d (%s) of this job_type and job_key has other job_data", cur.ID, cur.State)
	case err != nil:
		return err
	case created:
		count("accepted")
		writeJSON(w, http.StatusCreated, map[string]any{"job": jobJSON(cur)})
	default:
		count("duplicate")
		writeJSON(w, http.StatusOK, map[string]any{"job": jobJSON(cur)})
	}
	return nil
}

// getJob: GET /v1/jobs/{job_type}/{job_key}: the non-final job, else the
// latest final one, with its attempts.
//
// With ?job_id=I it is that job (of this type and key); with &wait=30s too
// (at most MaxWait) the answer waits until the job is final or the wait
// passes, and shows the job as it is then.
func (s *Server) getJob(w http.ResponseWriter, r *http.Request) error {
	jobType, jobKey := r.PathValue("job_type"), r.PathValue("job_key")
	id, wait, err := waitParams(r)
	if err != nil {
		return err
	}
	load := func(ctx context.Context) (*correlator.Job, error) {
		if id == 0 {
			return s.st.JobGet(ctx, jobType, jobKey)
		}
		j, err := s.st.JobGetByID(ctx, id)
		if err == nil && (j.JobType != jobType || j.JobKey != jobKey) {
			return nil, correlator.ErrNotFound
		}
		return j, err
	}
	j, err := load(r.Context())
	if err == nil && wait > 0 {
		j, err = s.waitFinal(r, j, wait, load)
	}
	if errors.Is(err, correlator.ErrNotFound) {
		return errorf(http.StatusNotFound, "not_found", "no job %s/%s", correlator.Clip(jobType, 255), correlator.Clip(jobKey, 1024))
	}
	if err != nil {
		return err
	}
	actx := r.Context()
	if base, ok := actx.Value(requestCtxKey{}).(context.Context); ok && wait > 0 {
		if base.Err() != nil {
			return nil // the caller left during the wait: nobody to answer
		}
		// The wait may have outlasted the request timeout: a fresh one.
		var cancel context.CancelFunc
		actx, cancel = context.WithTimeout(base, s.cfg.RequestTimeout)
		defer cancel()
	}
	attempts, err := s.st.AttemptList(actx, j.ID)
	if err != nil {
		return err
	}
	if attempts == nil {
		attempts = []store.Attempt{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"job": jobJSON(j), "attempts": attempts})
	return nil
}

// page cuts a list fetched with limit+1 rows to limit; the cursor of the
// next page is the last id kept, or nil when there is no more.
func page[T any](items []T, limit int, id func(T) int64) ([]T, any) {
	if len(items) <= limit {
		return items, nil
	}
	items = items[:limit]
	return items, strconv.FormatInt(id(items[limit-1]), 10)
}

// listLimit reads limit (default store.DefaultListLimit, at most
// store.MaxListLimit) and cursor (an id).
func listLimit(r *http.Request) (limit int, cursor int64, err error) {
	limit = store.DefaultListLimit
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > store.MaxListLimit {
			return 0, 0, errorf(http.StatusBadRequest, "invalid_parameter", "limit: %q is not a number from 1 to %d", v, store.MaxListLimit)
		}
		limit = n
	}
	if v := r.URL.Query().Get("cursor"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 {
			return 0, 0, errorf(http.StatusBadRequest, "invalid_parameter", "cursor: %q is not a cursor this API returned", v)
		}
		cursor = n
	}
	return limit, cursor, nil
}

// listJobs: GET /v1/jobs?job_type=&state=&queue=&limit=&cursor=, newest
// first; next_cursor is set when there may be more.
func (s *Server) listJobs(w http.ResponseWriter, r *http.Request) error {
	limit, cursor, err := listLimit(r)
	if err != nil {
		return err
	}
	q := r.URL.Query()
	for k := range q {
		if !slices.Contains([]string{"job_type", "state", "queue", "key_prefix", "limit", "cursor"}, k) {
			return errorf(http.StatusBadRequest, "invalid_parameter", "%s: unknown parameter (job_type, state, queue, key_prefix, limit, cursor)", k)
		}
	}
	state := correlator.State(q.Get("state"))
	if state != "" && !slices.Contains(correlator.States, state) {
		return errorf(http.StatusBadRequest, "invalid_parameter", "state: %q is not one of initial, running, error, retry, final", state)
	}
	jobs, err := s.st.JobList(r.Context(), store.JobListParams{JobType: q.Get("job_type"), State: state, Queue: q.Get("queue"),
		QueueTypes: s.queueTypes(q.Get("queue")), KeyPrefix: q.Get("key_prefix"), BeforeID: cursor, Limit: limit + 1})
	if err != nil {
		return err
	}
	jobs, next := page(jobs, limit, func(j *correlator.Job) int64 { return j.ID })
	out := map[string]any{"next_cursor": next}
	list := make([]*Job, len(jobs))
	for i, j := range jobs {
		list[i] = jobJSON(j)
	}
	out["jobs"] = list
	writeJSON(w, http.StatusOK, out)
	return nil
}

// queueTypes are the configured job types of a queue, sorted; none for "".
func (s *Server) queueTypes(queue string) []string {
	var out []string
	if queue == "" {
		return nil
	}
	for name, jt := range s.cfg.Types {
		if jt.Queue == queue {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// cancel: POST /v1/jobs/{job_type}/{job_key}/cancel: non-final → final /
// cancelled; 409 when the job is already final.
func (s *Server) cancel(w http.ResponseWriter, r *http.Request) error {
	j, err := s.st.JobCancel(r.Context(), r.PathValue("job_type"), r.PathValue("job_key"))
	switch {
	case errors.Is(err, correlator.ErrNotFound):
		return errorf(http.StatusNotFound, "not_found", "no job %s/%s", r.PathValue("job_type"), r.PathValue("job_key"))
	case errors.Is(err, store.ErrFinal):
		return errorf(http.StatusConflict, "final", "job %d is already final (%s)", j.ID, j.Outcome)
	case err != nil:
		return err
	}
	s.log.Info("job cancelled", append(tracing.LogFields(r.Context()), zap.Int64("job_id", j.ID), zap.String("job_type", j.JobType),
		zap.String("job_key", j.JobKey))...)
	writeJSON(w, http.StatusOK, map[string]any{"job": jobJSON(j)})
	return nil
}

// replay: POST /v1/jobs/{job_type}/{job_key}/replay: a final job → a new job
// with the same type, key and data; 409 while a non-final job exists.
func (s *Server) replay(w http.ResponseWriter, r *http.Request) error {
	jobType, jobKey := r.PathValue("job_type"), r.PathValue("job_key")
	jt, err := s.jobType(jobType)
	if err != nil {
		return err
	}
	j, err := s.st.JobReplay(r.Context(), jobType, jobKey, jt)
	switch {
	case errors.Is(err, correlator.ErrNotFound):
		return errorf(http.StatusNotFound, "not_found", "no job %s/%s", jobType, jobKey)
	case errors.Is(err, store.ErrConflict):
		return errorf(http.StatusConflict, correlator.CodeConflict, "job %d is not final (%s): only a final job can be replayed", j.ID, j.State)
	case err != nil:
		return err
	}
	writeJSON(w, http.StatusCreated, map[string]any{"job": jobJSON(j)})
	return nil
}

// pause: POST /v1/queues/{queue}/pause and …/resume.
func (s *Server) pause(paused bool) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		q := r.PathValue("queue")
		if !slices.Contains(s.cfg.Queues, q) {
			return errorf(http.StatusNotFound, "not_found", "queue %q is not declared", q)
		}
		if err := s.st.QueueSetPaused(r.Context(), q, paused); err != nil {
			return err
		}
		s.log.Info("queue paused or resumed", zap.String("queue", q), zap.Bool("paused", paused))
		writeJSON(w, http.StatusOK, map[string]any{"queue": q, "paused": paused})
		return nil
	}
}

// listQueues: GET /v1/queues: the declared queues and whether each is
// paused.
func (s *Server) listQueues(w http.ResponseWriter, r *http.Request) error {
	paused, err := s.st.QueuesPaused(r.Context())
	if err != nil {
		return err
	}
	type queue struct {
		Name   string `json:"name"`
		Paused bool   `json:"paused"`
	}
	out := make([]queue, 0, len(s.cfg.Queues))
	for _, q := range s.cfg.Queues {
		out = append(out, queue{Name: q, Paused: paused[q]})
	}
	writeJSON(w, http.StatusOK, map[string]any{"queues": out})
	return nil
}

// correlationOf are the request's Hipq-Correlation-* headers, which the
// job's outcome events carry back (lowercased, as Kafka headers are
// named).
func correlationOf(r *http.Request) []correlator.Header {
	var out []correlator.Header
	for _, k := range slices.Sorted(maps.Keys(r.Header)) {
		if lk := strings.ToLower(k); strings.HasPrefix(lk, correlator.HeaderCorrelationPrefix) && len(lk) > len(correlator.HeaderCorrelationPrefix) {
			for _, v := range r.Header[k] {
				out = append(out, correlator.Header{Key: lk, Value: []byte(v)})
			}
		}
	}
	return out
}

// traceOf is the trace context of an API call: the job's, when the call
// carries a valid traceparent.
func traceOf(r *http.Request) correlator.TraceContext {
	if trace.SpanContextFromContext(r.Context()).IsValid() {
		return tracing.Of(r.Context()) // the request's server span
	}
	return correlator.TraceContextOf([]correlator.Header{
		{Key: correlator.HeaderTraceParent, Value: []byte(r.Header.Get(correlator.HeaderTraceParent))},
		{Key: correlator.HeaderTraceState, Value: []byte(r.Header.Get(correlator.HeaderTraceState))}})
}

package api

import (
	"net/http"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/internal/tracing"
	"github.com/hipq/hipq/store"
)

// callback: POST /v1/jobs/{job_type}/{job_key}/response (SPEC §6). It is
// authorized by the sig of the callback URL hipq sent (over job_id,
// job_type, job_key and attempt) or by a bearer token; a sig that is
// present must be valid. The reply then follows the §6 table, fenced by
// job id and attempt: 200 applied, 200 duplicate or stale, 202 early, 400
// bad body, 401 unauthorized, 422 dead-lettered. A reply PostgreSQL
// refuses for a reason that is not its data (a privilege revoked, a
// failing trigger) is 503 and never dead-lettered: the caller keeps it and
// tries again (handle).
func (s *Server) callback(w http.ResponseWriter, r *http.Request) error {
	jobType, jobKey := r.PathValue("job_type"), r.PathValue("job_key")
	q := r.URL.Query()
	var jobID *int64
	var attempt *int
	var badParam error
	if v := q.Get("job_id"); v != "" {
		id, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			badParam = errorf(http.StatusBadRequest, "invalid_parameter", "job_id: %q is not a job id", correlator.Clip(v, 64))
		}
		jobID = &id
	}
	if v := q.Get("attempt"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			badParam = errorf(http.StatusBadRequest, "invalid_parameter", "attempt: %q is not an attempt number", correlator.Clip(v, 64))
		}
		attempt = &n
	}
	// Authorized first: an unparsable job_id or attempt cannot carry a
	// valid signature, so only a caller with a token learns it is bad.
	if err := s.callbackAuthorized(r, jobType, jobKey, jobID, attempt); err != nil {
		return err
	}
	if badParam != nil {
		return badParam
	}
	if err := checkPath(r); err != nil {
		return err
	}
	body, err := s.readBody(w, r)
	if err != nil {
		return err
	}
	reply, err := decodeCallback(body, jobType, jobKey, jobID, attempt, s.cfg.MaxBodyBytes)
	if err != nil {
		return inputError(err)
	}
	start := time.Now()
	res, err := s.st.ReplyApply(r.Context(), store.ReplyBatch{EarlyTTL: s.cfg.EarlyTTL, Replies: []store.ReplyIn{{
		Reply: reply, Kind: store.SourceCallback,
		Source: store.Source{Value: body, Headers: callbackHeaders(reply)},
	}}}, s.cfg.Types)
	if err != nil {
		return err
	}
	s.cfg.Metrics.ObserveReplies(metrics.SourceCallback, res.Counts(), res.RoundTrips())
	s.traceCallback(r, start, res)
	s.cfg.DeadLetters.Copy(res.DeadLetters)
	switch v := res.Verdicts[0]; v {
	case correlator.Apply:
		writeJSON(w, http.StatusOK, map[string]any{"applied": true})
	case correlator.Duplicate, correlator.Stale, correlator.Progressed:
		writeJSON(w, http.StatusOK, map[string]any{"applied": false, "reason": v.String()})
	case correlator.Early:
		writeJSON(w, http.StatusAccepted, map[string]any{"applied": false, "reason": "early"})
	default:
		err := deadLettered(res)
		s.log.Info("callback dead-lettered", append(tracing.LogFields(r.Context()), zap.String("job_type", jobType),
			zap.String("job_key", jobKey), zap.String("reason", err.Message))...)
		return err
	}
	return nil
}

// deadLettered is the 422 of a reply the API took in and dead-lettered,
// with the reason.
func deadLettered(res store.ReplyResult) *apiError {
	reason := "dead-lettered"
	if len(res.DeadLetters) > 0 {
		reason = res.DeadLetters[len(res.DeadLetters)-1].Reason
	}
	return &apiError{Status: http.StatusUnprocessableEntity, Code: "dead_lettered", Message: reason}
}

// callbackHeaders are what a callback's dead letter keeps of its URL, as
// hipq-* headers: the type, key, and the job id and attempt when given
// (never the sig). A replay reads the reply back from them and the body.
func callbackHeaders(r *correlator.Reply) []correlator.Header {
	hs := []correlator.Header{{Key: correlator.HeaderJobType, Value: []byte(r.JobType)}, {Key: correlator.HeaderJobKey, Value: []byte(r.JobKey)}}
	if r.JobID != nil {
		hs = append(hs, correlator.Header{Key: correlator.HeaderJobID, Value: strconv.AppendInt(nil, *r.JobID, 10)})
	}
	if r.Attempt != nil {
		hs = append(hs, correlator.Header{Key: correlator.HeaderAttempt, Value: strconv.AppendInt(nil, int64(*r.Attempt), 10)})
	}
	return hs
}

// callbackAuthorized: a sig, when present, must be valid for the URL's
// job id, type, key and attempt; without one, a valid bearer token is
// needed (when tokens are configured at all).
func (s *Server) callbackAuthorized(r *http.Request, jobType, jobKey string, jobID *int64, attempt *int) error {
	unauthorized := func(msg string) error {
		return errorf(http.StatusUnauthorized, "unauthorized", "%s", msg)
	}
	if sig := r.URL.Query().Get("sig"); sig != "" {
		if jobID == nil || attempt == nil {
			return unauthorized("a signed callback URL carries job_id and attempt")
		}
		if !correlator.CallbackSignatureValid(s.cfg.CallbackSecret, *jobID, jobType, jobKey, *attempt, sig) {
			return unauthorized("the signature does not match this callback URL")
		}
		return nil
	}
	if s.bearerRole(r) != roleAdmin {
		return unauthorized("use the signed Hipq-Callback-Url of the request, or an admin bearer token (api.tokens)")
	}
	return nil
}

// traceCallback records a span "process callback" for an applied
// callback, a child of its attempt's send span linked to the call's own
// trace context (tracing on).
func (s *Server) traceCallback(r *http.Request, start time.Time, res store.ReplyResult) {
	if s.cfg.Tracer == nil || len(res.Applied) == 0 {
		return
	}
	a := res.Applied[0]
	sends, err := s.st.AttemptTraces(r.Context(), []store.AttemptRef{a.AttemptRef})
	if err != nil {
		s.log.Debug("cannot read the attempt's send span", zap.Error(err))
	}
	end := a.Res
	tracing.RecordEnded(r.Context(), s.cfg.Tracer, tracing.Ended{Name: "process callback", Kind: trace.SpanKindServer, Start: start,
		Send: correlator.TraceContext{Parent: sends[a.AttemptRef]}, Own: traceOf(r), Result: &end,
		Attrs: append(tracing.AttemptAttrs(a.JobID, a.Attempt), attribute.String("messaging.operation.type", "process"))})
}

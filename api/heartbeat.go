package api

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// heartbeat: POST /v1/jobs/{job_type}/{job_key}/heartbeat?job_id=&attempt=&sig=
// (the Hipq-Heartbeat-Url of an HTTP request): news of a running attempt.
// It moves the attempt's deadline (never past the type's max_timeout) and
// records the body, any JSON value or none, as the attempt's progress. It
// can never end a job: its signature has a purpose of its own. The answer
// says whether the worker should go on: 200 {"accepted": true, "deadline"}
// while the attempt runs; 200 {"accepted": false, "state", "outcome",
// "cancelled"} once it is over (cancelled: stop now); 401 bad signature.
func (s *Server) heartbeat(w http.ResponseWriter, r *http.Request) error {
	jobType, jobKey := r.PathValue("job_type"), r.PathValue("job_key")
	q := r.URL.Query()
	id, err1 := strconv.ParseInt(q.Get("job_id"), 10, 64)
	attempt, err2 := strconv.Atoi(q.Get("attempt"))
	sig := q.Get("sig")
	if err1 != nil || err2 != nil || sig == "" || !correlator.HeartbeatSignatureValid(s.cfg.CallbackSecret, id, jobType, jobKey, attempt, sig) {
		return errorf(http.StatusUnauthorized, "unauthorized", "use the signed Hipq-Heartbeat-Url of the request")
	}
	if err := checkPath(r); err != nil {
		return err
	}
	body, err := s.readBody(w, r)
	if err != nil {
		return err
	}
	progress := json.RawMessage("null")
	if b := bytes.TrimSpace(body); len(b) > 0 {
		if err := correlator.CheckJSON(b, s.cfg.MaxBodyBytes); err != nil {
			return inputError(err)
		}
		progress = b
	}
	reply := &correlator.Reply{JobID: &id, JobType: jobType, JobKey: jobKey, Attempt: &attempt, Progress: true, Result: progress}
	res, err := s.st.ReplyApply(r.Context(), store.ReplyBatch{EarlyTTL: s.cfg.EarlyTTL, Replies: []store.ReplyIn{{
		Reply: reply, Kind: store.SourceCallback, Source: store.Source{Value: body, Headers: callbackHeaders(reply)},
	}}}, s.cfg.Types)
	if err != nil {
		return err
	}
	s.cfg.Metrics.ObserveReplies(metrics.SourceHeartbeat, res.Counts(), nil)
	s.cfg.DeadLetters.Copy(res.DeadLetters)
	if v := res.Verdicts[0]; v == correlator.Progressed {
		writeJSON(w, http.StatusOK, map[string]any{"accepted": true, "deadline": res.Deadlines[0]})
		return nil
	} else if v == correlator.DeadLetter {
		return deadLettered(res)
	}
	// Stale or over: say where the job is, so the worker knows to stop.
	out := map[string]any{"accepted": false, "cancelled": false}
	if j, err := s.st.JobGetByID(r.Context(), id); err == nil {
		out["state"], out["attempt"] = j.State, j.Attempt
		if j.Outcome != "" {
			out["outcome"] = j.Outcome
			out["cancelled"] = j.Outcome == correlator.OutcomeCancelled
		}
	} else {
		out["state"] = "gone"
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

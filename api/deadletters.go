package api

import (
	"errors"
	"net/http"
	"slices"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// DeadLetter is a dead letter as the API shows it.
type DeadLetter struct {
	ID         int64      `json:"id"`
	Source     string     `json:"source"`
	Topic      string     `json:"topic,omitempty"`
	Partition  int32      `json:"kafka_partition"`
	Offset     int64      `json:"kafka_offset"`
	Key        []byte     `json:"record_key"`
	Value      []byte     `json:"record_value"`
	Headers    []Header   `json:"headers"`
	Reason     string     `json:"reason"`
	ReceivedAt time.Time  `json:"received_at"`
	ReplayedAt *time.Time `json:"replayed_at"`
}

// Header is a record header; the value is base64 in JSON.
type Header struct {
	Key   string `json:"key"`
	Value []byte `json:"value"`
}

// listDeadLetters: GET /v1/dead-letters?source=&limit=&cursor=.
func (s *Server) listDeadLetters(w http.ResponseWriter, r *http.Request) error {
	limit, cursor, err := listLimit(r)
	if err != nil {
		return err
	}
	src := r.URL.Query().Get("source")
	if src != "" && !slices.Contains([]string{store.SourceIntake, store.SourceOutbox, store.SourceReply, store.SourceCallback}, src) {
		return errorf(http.StatusBadRequest, "invalid_parameter", "source: %q is not one of intake, outbox, reply, callback", correlator.Clip(src, 64))
	}
	dls, err := s.st.DeadLetterList(r.Context(), store.DeadLetterListParams{Kind: src, AfterID: cursor, Limit: limit + 1})
	if err != nil {
		return err
	}
	dls, next := page(dls, limit, func(d store.DeadLetter) int64 { return d.ID })
	out := map[string]any{"next_cursor": next}
	list := make([]DeadLetter, len(dls))
	for i, d := range dls {
		list[i] = DeadLetter{ID: d.ID, Source: d.Kind, Topic: d.Source.Topic, Partition: d.Source.Partition,
			Offset: d.Source.Offset, Key: d.Source.Key, Value: d.Source.Value, Headers: []Header{},
			Reason: d.Reason, ReceivedAt: d.Source.Received, ReplayedAt: d.Replayed}
		for _, h := range d.Source.Headers {
			list[i].Headers = append(list[i].Headers, Header{Key: h.Key, Value: h.Value})
		}
	}
	out["dead_letters"] = list
	writeJSON(w, http.StatusOK, out)
	return nil
}

// DeadLetterReplay is the answer to a replay.
type DeadLetterReplay struct {
	ID     int64  `json:"id"`
	Source string `json:"source"`
	// Result: for intake and outbox, accepted (a new job) or duplicate (a non-final
	// job with the same job_data exists); for replies, the §6 verdict:
	// applied, duplicate, stale or early.
	Result string `json:"result"`
	Job    *Job   `json:"job,omitempty"`
}

// replayDeadLetter: POST /v1/dead-letters/{id}/replay. The record goes
// again through the path it came from, with today's config (a job type
// added, a matcher fixed): intake records are decoded into a job, replies
// and callbacks are matched and applied. It answers 202 and sets
// replayed_at, in the same transaction as the effect. A record refused
// again is 422 with the new reason and changes nothing; a second replay is
// 409 (it could apply a reply to a later attempt).
func (s *Server) replayDeadLetter(w http.ResponseWriter, r *http.Request) error {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id < 1 {
		return errorf(http.StatusBadRequest, "invalid_parameter", "id: %q is not a dead letter id", r.PathValue("id"))
	}
	d, err := s.st.DeadLetterGet(r.Context(), id)
	if err != nil {
		return s.replayError(id, err)
	}
	if d.Replayed != nil {
		return s.replayError(id, store.ErrReplayed)
	}
	out := DeadLetterReplay{ID: id, Source: d.Kind}
	switch d.Kind {
	case store.SourceIntake, store.SourceOutbox:
		j, err := s.deadLetterJob(d)
		if err != nil {
			return stillRefused(err)
		}
		created, err := s.st.DeadLetterReplayIntake(r.Context(), id, j)
		if err != nil {
			return s.replayError(id, err)
		}
		out.Result = "duplicate"
		if created {
			out.Result = "accepted"
		}
		s.cfg.Metrics.IntakeRecords.WithLabelValues(metrics.SourceReplay, out.Result).Inc()
		if cur, err := s.st.JobGet(r.Context(), j.JobType, j.JobKey); err == nil {
			out.Job = jobJSON(cur)
		}
	case store.SourceReply, store.SourceCallback:
		reply, err := s.replyOf(d)
		if err != nil {
			return stillRefused(err)
		}
		res, err := s.st.DeadLetterReplayReply(r.Context(), id, store.ReplyIn{Reply: reply, Kind: d.Kind, Source: d.Source},
			s.cfg.Types, s.cfg.EarlyTTL)
		if err != nil {
			return s.replayError(id, err)
		}
		if res.Verdicts[0] == correlator.DeadLetter {
			reason := "refused again"
			if len(res.DeadLetters) > 0 {
				reason = res.DeadLetters[0].Reason
			}
			return errorf(http.StatusUnprocessableEntity, "still_refused", "%s", reason)
		}
		s.cfg.Metrics.ObserveReplies(metrics.SourceReplay, res.Counts(), res.RoundTrips())
		out.Result = res.Verdicts[0].String()
	default:
		return errorf(http.StatusUnprocessableEntity, "not_replayable", "dead letters of source %q cannot be replayed", d.Kind)
	}
	s.log.Info("dead letter replayed", zap.Int64("id", id), zap.String("source", d.Kind), zap.String("result", out.Result))
	writeJSON(w, http.StatusAccepted, out)
	return nil
}

// replyOf reads a reply dead letter again: a Kafka reply with its topic's
// matcher, a callback from the URL parts its headers keep and its body.
func (s *Server) replyOf(d store.DeadLetter) (*correlator.Reply, error) {
	if d.Kind == store.SourceReply {
		m, ok := s.cfg.Matchers[d.Source.Topic]
		if !ok {
			m = defaultMatcher
		}
		return m.Match(&correlator.Record{Key: d.Source.Key, Value: d.Source.Value, Headers: d.Source.Headers})
	}
	h := map[string]string{}
	for _, x := range d.Source.Headers {
		h[x.Key] = string(x.Value)
	}
	var jobID *int64
	var attempt *int
	if v, ok := h[correlator.HeaderJobID]; ok {
		id, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return nil, &correlator.InputError{Code: correlator.CodeInvalidField, Detail: "hipq-job-id: " + strconv.Quote(v)}
		}
		jobID = &id
	}
	if v, ok := h[correlator.HeaderAttempt]; ok {
		n, err := strconv.Atoi(v)
		if err != nil {
			return nil, &correlator.InputError{Code: correlator.CodeInvalidField, Detail: "hipq-attempt: " + strconv.Quote(v)}
		}
		attempt = &n
	}
	return decodeCallback(d.Source.Value, h[correlator.HeaderJobType], h[correlator.HeaderJobKey], jobID, attempt, s.cfg.MaxBodyBytes)
}

// stillRefused answers a replayed record that cannot be read even now.
func stillRefused(err error) error {
	return errorf(http.StatusUnprocessableEntity, "still_refused", "%v", err)
}

func (s *Server) replayError(id int64, err error) error {
	switch {
	case errors.Is(err, correlator.ErrNotFound):
		return errorf(http.StatusNotFound, "not_found", "no dead letter %d", id)
	case errors.Is(err, store.ErrReplayed):
		return errorf(http.StatusConflict, "already_replayed", "dead letter %d was replayed already", id)
	case errors.Is(err, store.ErrConflict):
		return errorf(http.StatusConflict, correlator.CodeConflict, "a non-final job with this job_type and job_key has other job_data")
	}
	return err
}

package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"

	"github.com/hipq/hipq/correlator"
)

// decodeEnqueue reads the body of PUT /v1/jobs/{type}/{key}: an intake
// request without job_type and job_key, which the URL gives. An empty
// body is an empty request. It validates exactly as intake does.
func decodeEnqueue(body []byte, jobType, jobKey string, maxBytes int) (*correlator.Request, error) {
	req, _, err := decodeEnqueueTo(body, jobType, jobKey, maxBytes)
	return req, err
}

// decodeEnqueueTo is decodeEnqueue that also reads the body's reply_to, the
// topic the job's final event goes to (what an intake record's header
// hipq-reply-to says): a string, or absent.
func decodeEnqueueTo(body []byte, jobType, jobKey string, maxBytes int) (*correlator.Request, string, error) {
	if err := correlator.CheckJobName(jobType, jobKey); err != nil {
		return nil, "", err
	}
	if len(bytes.TrimSpace(body)) == 0 {
		body = []byte("{}")
	}
	if err := correlator.CheckJSON(body, maxBytes); err != nil {
		return nil, "", err
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil || fields == nil {
		return nil, "", &correlator.InputError{Code: correlator.CodeNotObject, Detail: "the body must be a JSON object"}
	}
	for _, f := range []string{"job_type", "job_key"} {
		if _, ok := fields[f]; ok {
			return nil, "", &correlator.InputError{Code: correlator.CodeUnknownField, Detail: f + ": given by the URL, not the body"}
		}
	}
	var replyTo string
	if v, ok := fields["reply_to"]; ok {
		if err := json.Unmarshal(v, &replyTo); err != nil {
			return nil, "", &correlator.InputError{Code: correlator.CodeInvalidField, Field: "reply_to",
				Detail: "reply_to: must be a topic name (a string), got " + correlator.Clip(string(v), 64)}
		}
		delete(fields, "reply_to")
	}
	t, _ := json.Marshal(jobType)
	k, _ := json.Marshal(jobKey)
	fields["job_type"], fields["job_key"] = t, k
	full, err := json.Marshal(fields)
	if err != nil {
		return nil, "", &correlator.InputError{Code: correlator.CodeInvalidJSON, Detail: err.Error()}
	}
	req, err := correlator.DecodeRequest(full, 0)
	return req, replyTo, err
}

// callbackBody is the body of POST /v1/jobs/{type}/{key}/response.
type callbackBody struct {
	Status    string          `json:"status"`
	Attempt   *int            `json:"attempt"`
	Result    json.RawMessage `json:"result"`
	Error     string          `json:"error"`
	Retryable *bool           `json:"retryable"`
	// RetryAfter: seconds (a number or text) or a time before which a
	// failure's retry may not run.
	RetryAfter json.RawMessage `json:"retry_after"`
}

// defaultMatcher gives the status values a callback may use: the same as
// a Kafka reply read with the default matcher.
var defaultMatcher = correlator.DefaultMatcher()

// decodeCallback reads a callback body into a reply for (type, key). The
// URL's attempt (urlAttempt, when set) wins over the body's; jobID comes
// from the URL. Unknown fields are refused.
func decodeCallback(body []byte, jobType, jobKey string, jobID *int64, urlAttempt *int, maxBytes int) (*correlator.Reply, error) {
	if err := correlator.CheckJobName(jobType, jobKey); err != nil {
		return nil, err
	}
	if err := correlator.CheckJSON(body, maxBytes); err != nil {
		return nil, err
	}
	d := json.NewDecoder(bytes.NewReader(body))
	d.DisallowUnknownFields()
	var cb callbackBody
	if err := d.Decode(&cb); err != nil {
		var ute *json.UnmarshalTypeError
		switch {
		case errors.As(err, &ute):
			return nil, &correlator.InputError{Code: correlator.CodeInvalidField, Detail: fmt.Sprintf("%s: want %s, got %s", ute.Field, ute.Type, ute.Value)}
		case bytes.HasPrefix(bytes.TrimSpace(body), []byte("{")):
			return nil, &correlator.InputError{Code: correlator.CodeUnknownField, Detail: err.Error()}
		}
		return nil, &correlator.InputError{Code: correlator.CodeNotObject, Detail: "the body must be a JSON object"}
	}
	if d.More() {
		return nil, &correlator.InputError{Code: correlator.CodeInvalidJSON, Detail: "more than one JSON value"}
	}
	r := &correlator.Reply{JobID: jobID, JobType: jobType, JobKey: jobKey, Attempt: cb.Attempt, Retryable: true,
		Error: cb.Error, Result: cb.Result}
	if urlAttempt != nil {
		r.Attempt = urlAttempt
	}
	if r.Attempt != nil && *r.Attempt < 1 {
		return nil, &correlator.InputError{Code: correlator.CodeInvalidField, Detail: fmt.Sprintf("attempt: must be at least 1, got %d", *r.Attempt)}
	}
	switch {
	case slices.Contains(defaultMatcher.Success, cb.Status):
		r.Success = true
	case slices.Contains(defaultMatcher.Failure, cb.Status):
	case cb.Status == "":
		return nil, &correlator.InputError{Code: correlator.CodeMissingField, Detail: `status: required ("succeeded" or "failed")`}
	default:
		return nil, &correlator.InputError{Code: correlator.CodeInvalidField, Detail: fmt.Sprintf(`status: %q is neither "succeeded" nor "failed"`, cb.Status)}
	}
	if cb.Retryable != nil {
		r.Retryable = *cb.Retryable
	}
	if v := bytes.TrimSpace(cb.RetryAfter); len(v) > 0 && string(v) != "null" {
		s := string(v)
		if err := json.Unmarshal(v, &s); err != nil {
			s = string(v) // a number
		}
		ra, ok := correlator.ParseRetryAfter(s)
		if !ok {
			return nil, &correlator.InputError{Code: correlator.CodeInvalidField, Detail: fmt.Sprintf("retry_after: %s is neither seconds nor a time", correlator.Clip(string(v), 64))}
		}
		r.RetryAfter = ra
	}
	if len(r.Result) == 0 {
		r.Result = json.RawMessage("null")
	}
	return r, nil
}

// inputError maps a decoding error to 400 (or 413 for a body too large).
func inputError(err error) error {
	var ie *correlator.InputError
	if errors.As(err, &ie) {
		status := http.StatusBadRequest
		if ie.Code == correlator.CodeTooLarge && ie.Field == "" {
			status = http.StatusRequestEntityTooLarge
		}
		return &apiError{Status: status, Code: ie.Code, Message: ie.Detail}
	}
	return err
}

// checkName refuses a URL path value PostgreSQL could not store as text.

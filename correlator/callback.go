package correlator

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net/url"
	"strconv"
	"strings"
)

// CallbackSignature is the sig of a callback URL (SPEC §5): the unpadded
// base64url HMAC-SHA256, under secret, of "{job_id}\n{job_type}\n{job_key}\n{attempt}".
func CallbackSignature(secret []byte, jobID int64, jobType, jobKey string, attempt int) string {
	m := hmac.New(sha256.New, secret)
	fmt.Fprintf(m, "%d\n%s\n%s\n%d", jobID, jobType, jobKey, attempt)
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// CallbackSignatureValid compares sig with the expected signature in
// constant time.
func CallbackSignatureValid(secret []byte, jobID int64, jobType, jobKey string, attempt int, sig string) bool {
	want := CallbackSignature(secret, jobID, jobType, jobKey, attempt)
	return hmac.Equal([]byte(want), []byte(sig))
}

// CallbackURL is the Hipq-Callback-Url of one attempt:
// {publicURL}/v1/jobs/{type}/{key}/response?job_id=I&attempt=N&sig=S.
func CallbackURL(publicURL string, secret []byte, jobID int64, jobType, jobKey string, attempt int) string {
	q := url.Values{}
	q.Set("job_id", strconv.FormatInt(jobID, 10))
	q.Set("attempt", strconv.Itoa(attempt))
	q.Set("sig", CallbackSignature(secret, jobID, jobType, jobKey, attempt))
	return strings.TrimRight(publicURL, "/") + "/v1/jobs/" + url.PathEscape(jobType) + "/" + url.PathEscape(jobKey) +
		"/response?" + q.Encode()
}

// HeartbeatSignature is the sig of a heartbeat URL: as a callback's, over
// "heartbeat\n{job_id}\n{job_type}\n{job_key}\n{attempt}". Its own
// purpose: a callback's message starts with the job id's digits, so
// neither sig is ever valid as the other, and a heartbeat URL can never
// end a job.
func HeartbeatSignature(secret []byte, jobID int64, jobType, jobKey string, attempt int) string {
	m := hmac.New(sha256.New, secret)
	fmt.Fprintf(m, "heartbeat\n%d\n%s\n%s\n%d", jobID, jobType, jobKey, attempt)
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// HeartbeatSignatureValid compares sig with the expected signature in
// constant time.
func HeartbeatSignatureValid(secret []byte, jobID int64, jobType, jobKey string, attempt int, sig string) bool {
	want := HeartbeatSignature(secret, jobID, jobType, jobKey, attempt)
	return hmac.Equal([]byte(want), []byte(sig))
}

// HeartbeatURL is the Hipq-Heartbeat-Url of one attempt:
// {publicURL}/v1/jobs/{type}/{key}/heartbeat?job_id=I&attempt=N&sig=S.
func HeartbeatURL(publicURL string, secret []byte, jobID int64, jobType, jobKey string, attempt int) string {
	q := url.Values{}
	q.Set("job_id", strconv.FormatInt(jobID, 10))
	q.Set("attempt", strconv.Itoa(attempt))
	q.Set("sig", HeartbeatSignature(secret, jobID, jobType, jobKey, attempt))
	return strings.TrimRight(publicURL, "/") + "/v1/jobs/" + url.PathEscape(jobType) + "/" + url.PathEscape(jobKey) +
		"/heartbeat?" + q.Encode()
}

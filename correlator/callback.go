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
	return signature(secret, "", jobID, jobType, jobKey, attempt)
}

// CallbackSignatureValid compares sig with the expected signature in
// constant time.
func CallbackSignatureValid(secret []byte, jobID int64, jobType, jobKey string, attempt int, sig string) bool {
	return hmac.Equal([]byte(CallbackSignature(secret, jobID, jobType, jobKey, attempt)), []byte(sig))
}

// CallbackURL is the Hipq-Callback-Url of one attempt:
// {publicURL}/v1/jobs/{type}/{key}/response?job_id=I&attempt=N&sig=S.
func CallbackURL(publicURL string, secret []byte, jobID int64, jobType, jobKey string, attempt int) string {
	return signedURL(publicURL, "response", CallbackSignature(secret, jobID, jobType, jobKey, attempt), jobID, jobType, jobKey, attempt)
}

// HeartbeatSignature is the sig of a heartbeat URL: as a callback's, over
// "heartbeat\n{job_id}\n{job_type}\n{job_key}\n{attempt}". Its own
// purpose: a callback's message starts with the job id's digits, so
// neither sig is ever valid as the other, and a heartbeat URL can never
// end a job.
func HeartbeatSignature(secret []byte, jobID int64, jobType, jobKey string, attempt int) string {
	return signature(secret, "heartbeat\n", jobID, jobType, jobKey, attempt)
}

// HeartbeatSignatureValid compares sig with the expected signature in
// constant time.
func HeartbeatSignatureValid(secret []byte, jobID int64, jobType, jobKey string, attempt int, sig string) bool {
	return hmac.Equal([]byte(HeartbeatSignature(secret, jobID, jobType, jobKey, attempt)), []byte(sig))
}

// HeartbeatURL is the Hipq-Heartbeat-Url of one attempt:
// {publicURL}/v1/jobs/{type}/{key}/heartbeat?job_id=I&attempt=N&sig=S.
func HeartbeatURL(publicURL string, secret []byte, jobID int64, jobType, jobKey string, attempt int) string {
	return signedURL(publicURL, "heartbeat", HeartbeatSignature(secret, jobID, jobType, jobKey, attempt), jobID, jobType, jobKey, attempt)
}

func signature(secret []byte, purpose string, jobID int64, jobType, jobKey string, attempt int) string {
	m := hmac.New(sha256.New, secret)
	fmt.Fprintf(m, "%s%d\n%s\n%s\n%d", purpose, jobID, jobType, jobKey, attempt)
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

func signedURL(publicURL, action, sig string, jobID int64, jobType, jobKey string, attempt int) string {
	q := url.Values{}
	q.Set("job_id", strconv.FormatInt(jobID, 10))
	q.Set("attempt", strconv.Itoa(attempt))
	q.Set("sig", sig)
	return strings.TrimRight(publicURL, "/") + "/v1/jobs/" + url.PathEscape(jobType) + "/" + url.PathEscape(jobKey) +
		"/" + action + "?" + q.Encode()
}

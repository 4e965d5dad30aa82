package api

// The dashboard's bulk actions: the jobs and dead-letter lists offer to
// act on all that match their filter; a confirmation page shows the count
// and the filter, and its form (CSRF, admin only) posts the action through
// the API's own handler, as every dashboard action does.

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/store"
)

// bulkKinds are the bulk actions by their name in the dashboard's forms.
var bulkKinds = map[string]store.OperationKind{
	"cancel":              store.OperationCancel,
	"replay":              store.OperationReplay,
	"run-now":             store.OperationRunNow,
	"dead-letters-replay": store.OperationDeadLetterReplay,
}

// listCountLimit bounds the count a list shows ("10000+" past it): a
// count walks every matching row.
const listCountLimit = 10000

// listCountTimeout bounds the time a list spends counting what matches.
const listCountTimeout = 2 * time.Second

// bulkBodyOf is the API body of a bulk action from a form's (or a
// query's) filter fields.
func bulkBodyOf(form url.Values, kind store.OperationKind, reason string, dryRun bool) []byte {
	fields := jobFilterFields
	if !kind.ForJobs() {
		fields = deadLetterFilterFields
	}
	filter := map[string]string{}
	for _, k := range fields {
		if v := form.Get(k); v != "" {
			filter[k] = v
		}
	}
	b, _ := json.Marshal(map[string]any{"filter": filter, "reason": reason, "dry_run": dryRun})
	return b
}

type bulkData struct {
	Kind    string // as bulkKinds names it
	Verb    string // Cancel, Replay, Run now
	What    string // jobs, dead letters
	Applies string // what the action does, to which
	Matched int64
	// Filter is the filter as the action will run it, field by field, the
	// time bound fixed now: what the operator confirms is what was
	// counted.
	Filter [][2]string
	Back   string
}

// bulkConfirm: the confirmation page of a bulk action (admin only): the
// count and the filter, and the form that acts.
func (u *ui) bulkConfirm(r *http.Request, v *view) error {
	v.Page, v.Title = "bulk", "Act on all matching"
	if !v.Admin {
		return errorf(http.StatusForbidden, "forbidden", "only an admin token (api.tokens) may act on all matching")
	}
	q := r.URL.Query()
	name := q.Get("kind")
	kind, ok := bulkKinds[name]
	if !ok {
		return errorf(http.StatusBadRequest, "invalid_parameter", "kind: not one of cancel, replay, run-now, dead-letters-replay")
	}
	op, _, err := decodeBulk(bulkBodyOf(q, kind, "dashboard confirmation", true), kind)
	if err != nil {
		return inputError(err)
	}
	now, err := u.s.st.DatabaseNow(r.Context())
	if err != nil {
		return err
	}
	d := &bulkData{Kind: name, What: "jobs", Back: u.link("jobs", "queue", q.Get("queue"), "job_type", q.Get("job_type"),
		"state", q.Get("state"), "key_prefix", q.Get("key_prefix"))}
	switch kind {
	case store.OperationCancel:
		d.Verb, d.Applies = "Cancel", "Each job not final yet becomes final / cancelled."
	case store.OperationReplay:
		d.Verb, d.Applies = "Replay", "Each key whose newest job is final gets a new job with its data; an older job of a key, or a key with a job not final (replayed already), is skipped."
	case store.OperationRunNow:
		d.Verb, d.Applies = "Run now", "Each waiting job (initial, retry) scheduled later becomes due now; one due already is skipped."
	case store.OperationDeadLetterReplay:
		d.Verb, d.What, d.Back = "Replay", "dead letters", u.link("dead-letters", "source", q.Get("source"))
		d.Applies = "Each dead letter not replayed yet goes again through the path it came from; one refused again is skipped."
	}
	if op.Jobs != nil && op.Jobs.CreatedBefore == nil {
		op.Jobs.CreatedBefore = &now
	}
	if op.DeadLetters != nil && op.DeadLetters.ReceivedBefore == nil {
		op.DeadLetters.ReceivedBefore = &now
	}
	if d.Matched, err = u.s.st.OperationCount(r.Context(), op); err != nil {
		return err
	}
	b, _ := json.Marshal(operationJSON(op).Filter)
	var filter map[string]string
	_ = json.Unmarshal(b, &filter)
	for _, k := range append(slices.Clone(jobFilterFields), deadLetterFilterFields...) {
		if val, ok := filter[k]; ok {
			if t, err := time.Parse(time.RFC3339Nano, val); err == nil {
				val = t.UTC().Format(time.RFC3339Nano)
			}
			d.Filter = append(d.Filter, [2]string{k, val})
		}
	}
	v.Data = d
	return nil
}

// listCount is a list's "N matching" for its bulk actions: up to
// listCountLimit, shown as "10000+" past it; "" when the list has no
// filter (a bulk action needs one) or the page is the read role's.
func (u *ui) listCount(r *http.Request, v *view, op store.Operation) (string, error) {
	if !v.Admin {
		return "", nil
	}
	// The list shows whatever the count does: a count that takes too long
	// (a sparse filter over a large table) or fails leaves the list
	// without its bulk actions, never fails it.
	ctx, cancel := context.WithTimeout(r.Context(), listCountTimeout)
	defer cancel()
	n, err := u.s.st.OperationCountUpTo(ctx, op, listCountLimit+1)
	if err != nil {
		u.s.log.Warn("a list's matching count failed; its bulk actions are not offered", zap.Error(err))
		return "", nil
	}
	if n > listCountLimit {
		return "10000+", nil
	}
	return strconv.FormatInt(n, 10), nil
}

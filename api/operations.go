package api

// Bulk actions by filter: POST /v1/jobs/cancel, /v1/jobs/replay,
// /v1/jobs/run-now and /v1/dead-letters/replay make an operation
// (store.Operation) that this process works at once, in batches; the
// answer waits for it up to three quarters of the request timeout, then
// says 202 with the operation's id. GET /v1/operations/{id} shows it,
// DELETE stops it. An operation whose instance stopped or died is taken
// over by another instance's API (RunOperations), from its cursor.

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

// Defaults of the operations' worker.
const (
	// DefaultOperationLease is how long an instance holds an operation
	// after each batch: another takes it over once that has passed.
	DefaultOperationLease = 30 * time.Second
	// DefaultOperationPoll is how often RunOperations looks for
	// operations nobody holds.
	DefaultOperationPoll = 10 * time.Second
)

// codeEmptyFilter refuses a bulk action without a filter: one over every
// job is never what an operator meant.
const codeEmptyFilter = "empty_filter"

// Operation is a bulk operation as the API shows it.
type Operation struct {
	ID        int64     `json:"id"`
	Kind      string    `json:"kind"`
	Filter    any       `json:"filter"`
	Reason    string    `json:"reason"`
	TokenName string    `json:"token_name"`
	State     string    `json:"state"`
	Matched   int64     `json:"matched"`
	Done      int64     `json:"done"`
	Skipped   int64     `json:"skipped"`
	CreatedAt time.Time `json:"created_at"`
	UpdatedAt time.Time `json:"updated_at"`
}

func operationJSON(op store.Operation) Operation {
	out := Operation{ID: op.ID, Kind: string(op.Kind), Filter: op.Jobs, Reason: op.Reason, TokenName: op.TokenName,
		State: string(op.State), Matched: op.Matched, Done: op.Done, Skipped: op.Skipped, CreatedAt: op.CreatedAt, UpdatedAt: op.UpdatedAt}
	if !op.Kind.ForJobs() {
		out.Filter = op.DeadLetters
	}
	return out
}

// operations works this process's bulk operations: one goroutine each,
// for as long as the server lives (Close ends them, letting go of each
// operation for another instance to take at once).
type operations struct {
	s     *Server
	owner string
	life  context.Context
	end   context.CancelFunc
	wg    sync.WaitGroup
	mu    sync.Mutex
	// working are the operations this process works, each with a channel
	// closed when its worker returns.
	working map[int64]chan struct{}
}

func newOperations(s *Server) *operations {
	owner := s.cfg.Instance
	if owner == "" {
		b := make([]byte, 4)
		_, _ = rand.Read(b)
		owner = "api-" + hex.EncodeToString(b)
	}
	life, end := context.WithCancel(context.Background())
	return &operations{s: s, owner: owner, life: life, end: end, working: map[int64]chan struct{}{}}
}

// start works the operation, held by this process already, unless a
// worker of this process works it; the channel closes when that worker
// returns.
func (o *operations) start(id int64) <-chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	if done, ok := o.working[id]; ok {
		return done
	}
	done := make(chan struct{})
	if o.life.Err() != nil {
		close(done)
		return done
	}
	o.working[id] = done
	o.wg.Add(1)
	go o.work(id, done)
	return done
}

// work runs the operation's batches until it ends, is stopped or taken
// over, or the server closes. After each batch it pauses as long as the
// batch took, so an operation takes at most half of one connection's
// time and the hot path's statements find the rows and the server free.
func (o *operations) work(id int64, done chan struct{}) {
	defer func() {
		o.mu.Lock()
		delete(o.working, id)
		o.mu.Unlock()
		close(done)
		o.wg.Done()
	}()
	w := store.OperationWork{Owner: o.owner, Lease: o.s.cfg.OperationLease, Batch: o.s.cfg.OperationBatch,
		Types: o.s.cfg.Types, EarlyTTL: o.s.cfg.EarlyTTL, DecodeDeadLetter: o.s.deadLetterInput}
	failures := 0
	for {
		began := time.Now()
		op, err := o.s.st.OperationStep(o.life, id, w)
		pause := time.Since(began)
		switch {
		case errors.Is(err, store.ErrOperationLost):
			return
		case err != nil && o.life.Err() != nil:
			o.release(id)
			return
		case err != nil:
			failures++
			if failures == 1 || failures%60 == 0 {
				o.s.log.Warn("a batch of a bulk operation failed; trying again", zap.Int64("operation_id", id),
					zap.Int("failures", failures), zap.Error(err))
			}
			pause = time.Second
		case op.State == store.OperationDone:
			o.s.logOperation("bulk action done", op)
			return
		default:
			failures = 0
		}
		t := time.NewTimer(pause)
		select {
		case <-o.life.Done():
			t.Stop()
			o.release(id)
			return
		case <-t.C:
		}
	}
}

// release lets go of an operation for another instance to take at once.
func (o *operations) release(id int64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(o.life), 5*time.Second)
	defer cancel()
	if err := o.s.st.OperationRelease(ctx, id, o.owner); err != nil {
		o.s.log.Warn("could not let go of a bulk operation; another instance takes it once its lease has passed",
			zap.Int64("operation_id", id), zap.Error(err))
	}
}

// resume takes and works the running operations nobody holds.
func (o *operations) resume(ctx context.Context) error {
	ids, err := o.s.st.OperationsAbandoned(ctx)
	if err != nil {
		return err
	}
	for _, id := range ids {
		o.mu.Lock()
		_, mine := o.working[id]
		o.mu.Unlock()
		if mine {
			continue
		}
		ok, err := o.s.st.OperationTake(ctx, id, o.owner, o.s.cfg.OperationLease)
		if err != nil {
			return err
		}
		if ok {
			o.s.log.Info("bulk operation taken over", zap.Int64("operation_id", id), zap.String("instance", o.owner))
			o.start(id)
		}
	}
	return nil
}

// RunOperations resumes, every cfg.OperationPoll, the bulk operations
// nobody works (their instance stopped or died), until ctx ends; then it
// stops the operations this server works, letting go of them for another
// instance to take. Run calls it; a server serving through Handler only
// works the operations it starts.
func (s *Server) RunOperations(ctx context.Context) error {
	defer s.Close()
	t := time.NewTicker(s.cfg.OperationPoll)
	defer t.Stop()
	var warned time.Time
	for {
		if err := s.ops.resume(ctx); err != nil && ctx.Err() == nil && time.Since(warned) > time.Minute {
			warned = time.Now()
			s.log.Warn("cannot look for bulk operations to resume", zap.Error(err))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Close stops the bulk operations this server works, each after its batch
// under way, letting go of them for another instance to take.
func (s *Server) Close() {
	s.ops.end()
	s.ops.wg.Wait()
}

// logOperation logs an operation once, as it ends: what, why, who, how many.
func (s *Server) logOperation(msg string, op store.Operation) {
	j := operationJSON(op)
	s.log.Info(msg, zap.Int64("operation_id", op.ID), zap.String("kind", j.Kind), zap.Any("filter", j.Filter),
		zap.String("reason", op.Reason), zap.String("token_name", op.TokenName), zap.String("state", j.State),
		zap.Int64("matched", op.Matched), zap.Int64("done", op.Done), zap.Int64("skipped", op.Skipped))
}

// bulkBody is the body of a bulk action.
type bulkBody struct {
	Filter json.RawMessage `json:"filter"`
	Reason string          `json:"reason"`
	DryRun bool            `json:"dry_run"`
}

// bulk: POST /v1/jobs/cancel, /v1/jobs/replay, /v1/jobs/run-now and
// /v1/dead-letters/replay.
func (s *Server) bulk(kind store.OperationKind) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		body, err := s.readBody(w, r)
		if err != nil {
			return err
		}
		op, dryRun, err := decodeBulk(body, kind)
		if err != nil {
			return inputError(err)
		}
		op.TokenName = s.tokenName(r)
		now, err := s.st.DatabaseNow(r.Context())
		if err != nil {
			return err
		}
		// Only what existed when asked: the operation ends even while new
		// jobs keep arriving.
		if op.Jobs != nil && op.Jobs.CreatedBefore == nil {
			op.Jobs.CreatedBefore = &now
		}
		if op.DeadLetters != nil && op.DeadLetters.ReceivedBefore == nil {
			op.DeadLetters.ReceivedBefore = &now
		}
		if dryRun {
			n, err := s.st.OperationCount(r.Context(), op)
			if err != nil {
				return err
			}
			op.Matched = n
			j := operationJSON(op)
			s.log.Info("bulk action counted (dry run)", zap.String("kind", j.Kind), zap.Any("filter", j.Filter),
				zap.String("reason", op.Reason), zap.String("token_name", op.TokenName), zap.Int64("matched", n))
			writeJSON(w, http.StatusOK, map[string]any{"dry_run": true, "kind": j.Kind, "filter": j.Filter, "matched": n})
			return nil
		}
		op, err = s.st.OperationCreate(r.Context(), op, s.ops.owner, s.cfg.OperationLease)
		if err != nil {
			return err
		}
		done := s.ops.start(op.ID)
		t := time.NewTimer(s.cfg.RequestTimeout * 3 / 4)
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
		case <-r.Context().Done():
		}
		return s.answerOperation(w, r, op.ID, http.StatusOK)
	}
}

// answerOperation answers with the operation as it is: status when it has
// ended, else 202 with where to follow it.
func (s *Server) answerOperation(w http.ResponseWriter, r *http.Request, id int64, status int) error {
	// (the request's own time may be spent: the answer gets a moment more)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 5*time.Second)
	defer cancel()
	op, err := s.st.OperationGet(ctx, id)
	if err != nil {
		return err
	}
	if op.State == store.OperationRunning {
		status = http.StatusAccepted
		w.Header().Set("Location", "/v1/operations/"+strconv.FormatInt(id, 10))
	}
	writeJSON(w, status, map[string]any{"operation": operationJSON(op)})
	return nil
}

func operationID(r *http.Request) (int64, error) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id < 1 {
		return 0, errorf(http.StatusBadRequest, "invalid_parameter", "id: %q is not an operation id", correlator.Clip(r.PathValue("id"), 64))
	}
	return id, nil
}

// getOperation: GET /v1/operations/{id}.
func (s *Server) getOperation(w http.ResponseWriter, r *http.Request) error {
	id, err := operationID(r)
	if err != nil {
		return err
	}
	op, err := s.st.OperationGet(r.Context(), id)
	if errors.Is(err, correlator.ErrNotFound) {
		return errorf(http.StatusNotFound, "not_found", "no operation %d", id)
	}
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"operation": operationJSON(op)})
	return nil
}

// stopOperation: DELETE /v1/operations/{id}. No batch of it runs after
// the answer; stopping a stopped one is no error, a done one is 409.
func (s *Server) stopOperation(w http.ResponseWriter, r *http.Request) error {
	id, err := operationID(r)
	if err != nil {
		return err
	}
	op, stopped, err := s.st.OperationStop(r.Context(), id)
	switch {
	case errors.Is(err, correlator.ErrNotFound):
		return errorf(http.StatusNotFound, "not_found", "no operation %d", id)
	case errors.Is(err, store.ErrOperationEnded):
		return errorf(http.StatusConflict, "final", "operation %d has ended already (%s)", id, op.State)
	case err != nil:
		return err
	}
	if stopped {
		s.logOperation("bulk action stopped", op)
	}
	writeJSON(w, http.StatusOK, map[string]any{"operation": operationJSON(op)})
	return nil
}

type tokenNameKey struct{}

// tokenName names the token of the request without revealing it: the
// first 8 hex digits of its SHA-256 (printf %s "$TOKEN" | sha256sum).
// The dashboard passes its session's on the context.
func (s *Server) tokenName(r *http.Request) string {
	if name, ok := r.Context().Value(tokenNameKey{}).(string); ok {
		return name
	}
	if len(s.cfg.Tokens) == 0 {
		return "none (api.tokens is empty)"
	}
	token, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return nameOf(token)
}

func nameOf(token string) string {
	sum := sha256.Sum256([]byte(token))
	return "sha256:" + hex.EncodeToString(sum[:4])
}

// deadLetterJob reads an intake or outbox dead letter again as a job,
// with today's config, as its record would be read now: its trace
// context, reply_to (checked against events.allowed_reply_to) and
// correlation headers taken from the record's headers.
func (s *Server) deadLetterJob(d store.DeadLetter) (*correlator.Job, error) {
	j, err := correlator.DecodeJob(d.Source.Value, s.cfg.MaxBodyBytes, s.cfg.Types, time.Now())
	if err == nil {
		err = j.TakeHeaders(d.Source.Headers, s.cfg.Types.Get(j.JobType))
	}
	return j, err
}

// deadLetterInput reads a dead letter again with today's config, for a
// bulk replay: an intake or outbox record as a job, a reply or callback as
// a reply.
func (s *Server) deadLetterInput(d store.DeadLetter) (*correlator.Job, *store.ReplyIn, error) {
	switch d.Kind {
	case store.SourceIntake, store.SourceOutbox:
		j, err := s.deadLetterJob(d)
		if err != nil {
			return nil, nil, err
		}
		return j, nil, nil
	case store.SourceReply, store.SourceCallback:
		reply, err := s.replyOf(d)
		if err != nil {
			return nil, nil, err
		}
		return nil, &store.ReplyIn{Reply: reply, Kind: d.Kind, Source: d.Source}, nil
	}
	return nil, nil, fmt.Errorf("dead letters of source %q cannot be replayed", d.Kind)
}

// The fields of the filters, in the order errors list them.
var (
	jobFilterFields        = []string{"queue", "job_type", "state", "outcome", "key_prefix", "created_before", "created_after", "updated_before", "updated_after"}
	deadLetterFilterFields = []string{"source", "reason_prefix", "received_before", "received_after"}
)

// decodeBulk reads a bulk action's body: a filter with at least one field,
// a reason, dry_run. Every field is checked, and named when refused.
func decodeBulk(body []byte, kind store.OperationKind) (store.Operation, bool, error) {
	op := store.Operation{Kind: kind}
	bad := func(code, format string, args ...any) (store.Operation, bool, error) {
		return op, false, &correlator.InputError{Code: code, Detail: fmt.Sprintf(format, args...)}
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil || top == nil {
		return bad(correlator.CodeNotObject, "the body must be a JSON object: {\"filter\": {...}, \"reason\": \"...\"}")
	}
	for k := range top {
		if !slices.Contains([]string{"filter", "reason", "dry_run"}, k) {
			return bad(correlator.CodeUnknownField, "%s: unknown field (filter, reason, dry_run)", correlator.Clip(k, 64))
		}
	}
	var b bulkBody
	d := json.NewDecoder(bytes.NewReader(body))
	if err := d.Decode(&b); err != nil {
		var ute *json.UnmarshalTypeError
		if errors.As(err, &ute) {
			return bad(correlator.CodeInvalidField, "%s: want %s, got %s", ute.Field, ute.Type, ute.Value)
		}
		return bad(correlator.CodeInvalidJSON, "%v", err)
	}
	op.Reason = strings.TrimSpace(b.Reason)
	if op.Reason == "" {
		return bad(correlator.CodeMissingField, "reason: required: say why (it is logged and kept with the operation)")
	}
	if len(op.Reason) > 1000 || !validText(op.Reason) {
		return bad(correlator.CodeInvalidField, "reason: at most 1,000 bytes of UTF-8 text")
	}
	fields := jobFilterFields
	if !kind.ForJobs() {
		fields = deadLetterFilterFields
	}
	var filter map[string]json.RawMessage
	if len(b.Filter) > 0 && string(b.Filter) != "null" {
		if err := json.Unmarshal(b.Filter, &filter); err != nil || filter == nil {
			return bad(correlator.CodeInvalidField, "filter: want an object of %s", strings.Join(fields, ", "))
		}
	}
	if len(filter) == 0 {
		return bad(codeEmptyFilter, "filter: empty: give at least one of %s (a bulk action over everything is refused)", strings.Join(fields, ", "))
	}
	str := map[string]string{}
	times := map[string]*time.Time{}
	for k, v := range filter {
		if !slices.Contains(fields, k) {
			return bad(correlator.CodeUnknownField, "filter.%s: unknown field (%s)", correlator.Clip(k, 64), strings.Join(fields, ", "))
		}
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			return bad(correlator.CodeInvalidField, "filter.%s: want a string", k)
		}
		if strings.HasSuffix(k, "_before") || strings.HasSuffix(k, "_after") {
			t, err := time.Parse(time.RFC3339Nano, s)
			if err != nil {
				return bad(correlator.CodeInvalidField, "filter.%s: %q is not an RFC 3339 time (2006-01-02T15:04:05Z)", k, correlator.Clip(s, 64))
			}
			times[k] = &t
			continue
		}
		if err := correlator.CheckName("filter."+k, s, correlator.MaxJobKeyBytes); err != nil {
			return op, false, err
		}
		str[k] = s
	}
	if !kind.ForJobs() {
		f := &store.DeadLetterFilter{Source: str["source"], ReasonPrefix: str["reason_prefix"],
			ReceivedBefore: times["received_before"], ReceivedAfter: times["received_after"]}
		sources := []string{store.SourceIntake, store.SourceOutbox, store.SourceReply, store.SourceCallback}
		if f.Source != "" && !slices.Contains(sources, f.Source) {
			return bad(correlator.CodeInvalidField, "filter.source: %q is not one of %s", correlator.Clip(f.Source, 64), strings.Join(sources, ", "))
		}
		op.DeadLetters = f
		return op, b.DryRun, nil
	}
	f := &store.JobFilter{Queue: str["queue"], JobType: str["job_type"], State: correlator.State(str["state"]),
		Outcome: correlator.Outcome(str["outcome"]), KeyPrefix: str["key_prefix"], CreatedBefore: times["created_before"],
		CreatedAfter: times["created_after"], UpdatedBefore: times["updated_before"], UpdatedAfter: times["updated_after"]}
	// Each action applies to some states only: a filter for others
	// would match nothing, and is a mistake worth saying.
	applies := map[store.OperationKind][]correlator.State{
		store.OperationCancel: {correlator.StateInitial, correlator.StateRunning, correlator.StateRetry},
		store.OperationReplay: {correlator.StateFinal},
		store.OperationRunNow: {correlator.StateInitial, correlator.StateRetry},
	}[kind]
	var names []string
	for _, st := range applies {
		names = append(names, string(st))
	}
	if f.State != "" && !slices.Contains(applies, f.State) {
		return bad(correlator.CodeInvalidField, "filter.state: %q: %s acts on jobs in %s only", correlator.Clip(string(f.State), 64), kind,
			strings.Join(names, ", "))
	}
	outcomes := []correlator.Outcome{correlator.OutcomeSucceeded, correlator.OutcomeFailed, correlator.OutcomeTimedOut,
		correlator.OutcomeExpired, correlator.OutcomeCancelled}
	switch {
	case f.Outcome != "" && kind != store.OperationReplay:
		return bad(correlator.CodeInvalidField, "filter.outcome: only final jobs have one, and %s acts on jobs in %s", kind, strings.Join(names, ", "))
	case f.Outcome != "" && !slices.Contains(outcomes, f.Outcome):
		return bad(correlator.CodeInvalidField, "filter.outcome: %q is not one of succeeded, failed, timed_out, expired, cancelled",
			correlator.Clip(string(f.Outcome), 64))
	}
	op.Jobs = f
	return op, b.DryRun, nil
}

// validText: UTF-8 without NUL, as PostgreSQL's text takes it.
func validText(s string) bool {
	return correlator.CheckName("reason", s, len(s)) == nil
}

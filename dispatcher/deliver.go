package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/internal/metrics"
	"github.com/hipq/hipq/store"
)

// dispatch starts the deliveries of claimed jobs, one per neighbour: a
// slow host's calls never hold back the record of another's.
func (d *Dispatcher) dispatch(ctx context.Context, q QueueConfig, claimed []store.Claimed) {
	type to struct {
		s Sender
		n string
	}
	by := map[to][]store.Claimed{}
	for _, c := range claimed {
		if c.WindowsErr != nil {
			d.log.Warn("job's time windows unreadable here; taken as open, as the claim takes them", zap.Int64("job_id", c.ID),
				zap.String("job_type", c.JobType), zap.Error(c.WindowsErr))
		}
		s := d.cfg.Senders[c.JobType] // nil: not sendable here after all; its claim is undone
		k := to{s, d.route(s, c.JobType).Neighbour}
		if by[k] == nil {
			by[k] = make([]store.Claimed, 0, len(claimed)) // most rounds have one neighbour
		}
		by[k] = append(by[k], c)
	}
	for k, jobs := range by {
		d.start(ctx, q, k.s, jobs)
	}
}

// start runs one delivery in its own goroutine, counting its jobs in flight
// until their record lands.
func (d *Dispatcher) start(ctx context.Context, q QueueConfig, s Sender, jobs []store.Claimed) {
	d.room.hold(len(jobs))
	d.mu.Lock()
	for _, c := range jobs {
		d.byType[c.JobType]++
	}
	d.mu.Unlock()
	d.sends.Add(1)
	go func() {
		defer d.sends.Done()
		err := d.deliver(ctx, q, s, jobs)
		d.room.release(len(jobs))
		d.mu.Lock()
		for _, c := range jobs {
			d.byType[c.JobType]--
		}
		if err != nil {
			d.errs = append(d.errs, err)
		}
		d.mu.Unlock()
		d.Wake()
	}()
}

// deliver sends one neighbour's share of a claim and records what became
// of each send in one transaction (store.DeliveryRecord): sent_at, undone
// claims, dispatch errors through the retry policy, replies that came with
// the send, and early replies waiting for these jobs.
func (d *Dispatcher) deliver(ctx context.Context, q QueueConfig, s Sender, jobs []store.Claimed) error {
	var results []Result
	endSpans := d.startSends(ctx, s, jobs)
	if s != nil {
		results = s.Send(ctx, jobs)
	} else {
		results = make([]Result, len(jobs))
		for i := range results {
			results[i] = Result{Status: NotSent, Err: errors.New("no transport for this job type here")}
		}
	}
	var (
		rec      store.Delivery
		byStatus [Failed + 1]int
		undone   = map[string]int{} // by neighbour
		resent   = map[string]int{} // by neighbour: sends in doubt, to be sent again
		reached  = map[string]bool{}
		refused  = map[string]error{} // by neighbour: one of its refusals
		notSent  = map[string]error{}
	)
	for i, r := range results {
		switch r.Status {
		case Refused:
			refused[d.route(s, jobs[i].JobType).Neighbour] = r.Err
		case NotSent:
			notSent[d.route(s, jobs[i].JobType).Neighbour] = r.Err
		}
	}
	ages := d.refusedBy(refused, true) // how long each refusing neighbour has refused
	d.refusedBy(notSent, false)        // sends that could not start back off too, never to spin
	for i, r := range results {
		c := &jobs[i]
		ref := c.Ref()
		jt := d.cfg.Types[c.JobType]
		route := d.route(s, c.JobType)
		byStatus[r.Status]++
		switch r.Status {
		case Sent:
			reached[route.Neighbour] = true
			rec.Sent = append(rec.Sent, ref)
			if r.Reply != nil {
				rec.Replies = append(rec.Replies, store.ReplyIn{Reply: r.Reply, Kind: store.SourceCallback, Queue: c.Queue,
					Source: store.Source{Value: r.Reply.Result}})
			}
		case NotSent:
			rec.Undo = append(rec.Undo, ref)
			undone[route.Neighbour]++
		case Refused:
			if age := ages[route.Neighbour]; route.Timeout > 0 && age >= route.Timeout {
				err := fmt.Errorf("%s has refused every send for %s, longer than the send timeout (%s): %w",
					route.Neighbour, age.Round(time.Second), route.Timeout, r.Err)
				r := dispatchError(c, jt, Result{Err: err}, true, false)
				r.NeverLeft = true // every send was refused: none left
				rec.Resolves = append(rec.Resolves, r)
			} else {
				rec.Undo = append(rec.Undo, ref)
				undone[route.Neighbour]++
			}
		case Unknown:
			if resend, res := correlator.SendUnknown(jt, errText(r.Err)); !resend {
				rec.Resolves = append(rec.Resolves, store.Resolve{Queue: c.Queue, JobID: c.ID, Attempt: c.Attempt, Claim: c.StartedAt, Res: res})
			} else {
				rec.Resend = append(rec.Resend, ref) // it may have left: its rate units keep counting
				resent[route.Neighbour]++
			}
		case Failed:
			if r.Answered {
				reached[route.Neighbour] = true
			}
			res := dispatchError(c, jt, r, !r.Final, r.Answered)
			res.NeverLeft = r.Unwritten && !r.Answered
			rec.Resolves = append(rec.Resolves, res)
		}
	}
	for n := range reached {
		_, r := refused[n]
		_, ns := notSent[n]
		if !r && !ns {
			d.recovered(n)
		}
	}
	for st, n := range byStatus {
		add(d.m.Dispatches.WithLabelValues(q.Name, transportName(s), statusLabels[st]), n)
	}
	if endSpans != nil {
		endSpans(results)
	}
	res, err := d.record(ctx, rec)
	if err != nil {
		return err
	}
	for n, k := range undone {
		d.log.Warn("claims undone: their requests never left", zap.String("queue", q.Name), zap.String("to", n),
			zap.Int("jobs", k))
	}
	for n, k := range resent {
		d.log.Warn("claims undone to be sent again: their sends ended in doubt, and they count in their rate windows",
			zap.String("queue", q.Name), zap.String("to", n), zap.Int("jobs", k))
	}
	if len(rec.Replies) > 0 {
		d.m.ObserveReplies(metrics.SourceSync, res.Replies.Counts(), res.Replies.RoundTrips())
		d.traceSyncReplies(ctx, jobs, res.Replies)
	}
	d.m.ObserveReplies(metrics.SourceEarly, res.Early.Counts(), res.Early.RoundTrips())
	d.cfg.DeadLetters.Copy(append(res.Replies.DeadLetters, res.Early.DeadLetters...))
	if n := len(res.Early.Applied); n > 0 {
		d.log.Info("early replies applied", zap.Int("replies", n))
	}
	return nil
}

func transportName(s Sender) string {
	if s == nil {
		return "none"
	}
	return s.Transport()
}

func (d *Dispatcher) route(s Sender, jobType string) Route {
	if s == nil {
		return Route{Neighbour: "none"}
	}
	return s.Route(jobType)
}

// record writes a delivery's record, trying again with backoff while
// PostgreSQL fails for a reason that may pass (IsTransient), until it lands
// or ctx ends: a delivered request must never look unsent to the sweeper,
// nor a reply be lost, because PostgreSQL blinked. A record PostgreSQL
// refuses for good is recorded job by job; a job whose own record is
// refused again is recorded without what PostgreSQL refused (a reply, a
// text), and if even that is refused it is left to the sweeper.
func (d *Dispatcher) record(ctx context.Context, rec store.Delivery) (store.DeliveryResult, error) {
	res, err := d.retry(ctx, rec)
	if err == nil || ctx.Err() != nil {
		return res, err
	}
	d.log.Error("PostgreSQL refused a delivery record; recording its jobs one by one", zap.Error(err))
	var out store.DeliveryResult
	var errs []error
	for _, one := range splitDelivery(rec) {
		r, err := d.retry(ctx, one)
		if err != nil && ctx.Err() == nil {
			r, err = d.retry(ctx, d.stripped(one, err))
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("record the send of job %v: %w", one.Jobs(), err))
			continue
		}
		out.Undone += r.Undone
		out.Replies.Merge(r.Replies)
		out.Early.Merge(r.Early)
	}
	return out, errors.Join(errs...)
}

// retry writes one record, again with backoff while PostgreSQL's failure
// may pass; it returns the first failure that will not.
func (d *Dispatcher) retry(ctx context.Context, rec store.Delivery) (store.DeliveryResult, error) {
	for try := 0; ; try++ {
		res, err := d.st.DeliveryRecord(ctx, rec, d.cfg.Types)
		switch {
		case err == nil:
			if try > 0 {
				d.log.Info("sends recorded after PostgreSQL failures", zap.Int("tries", try+1))
			}
			return res, nil
		case ctx.Err() != nil || !store.IsTransient(err):
			return res, fmt.Errorf("record sends: %w", err)
		}
		wait := backoff(try)
		d.log.Warn("cannot record sends; trying again", zap.Int("jobs", len(rec.Jobs())), zap.Int("try", try+1),
			zap.Duration("in", wait), zap.Error(err))
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// splitDelivery cuts a delivery into one per job.
func splitDelivery(rec store.Delivery) []store.Delivery {
	var out []store.Delivery
	replies := map[int64]store.ReplyIn{}
	for _, r := range rec.Replies {
		if r.Reply.JobID != nil {
			replies[*r.Reply.JobID] = r
		}
	}
	for _, r := range rec.Sent {
		one := store.Delivery{Sent: []store.AttemptRef{r}}
		if in, ok := replies[r.JobID]; ok {
			one.Replies = []store.ReplyIn{in}
		}
		out = append(out, one)
	}
	for _, r := range rec.Undo {
		out = append(out, store.Delivery{Undo: []store.AttemptRef{r}})
	}
	for _, r := range rec.Resend {
		out = append(out, store.Delivery{Resend: []store.AttemptRef{r}})
	}
	for _, r := range rec.Resolves {
		out = append(out, store.Delivery{Resolves: []store.Resolve{r}})
	}
	return out
}

// stripped is one job's delivery without anything PostgreSQL could refuse:
// a reply it refused ends the attempt failed, saying why.
func (d *Dispatcher) stripped(one store.Delivery, cause error) store.Delivery {
	unstorable := correlator.ReplyUnstorable(cause.Error())
	out := store.Delivery{Sent: one.Sent, Undo: one.Undo, Resend: one.Resend}
	claims := map[int64]time.Time{} // the claims sent: a sync reply answers one
	for _, r := range one.Sent {
		claims[r.JobID] = r.Claim
	}
	for _, r := range one.Replies {
		if r.Reply.JobID == nil || r.Reply.Attempt == nil {
			continue
		}
		out.Resolves = append(out.Resolves, store.Resolve{Queue: r.Queue, JobID: *r.Reply.JobID, Attempt: *r.Reply.Attempt,
			Claim: claims[*r.Reply.JobID], Sent: true, Res: unstorable})
	}
	for _, r := range one.Resolves {
		r.Reply, r.Result = nil, nil
		r.Res.AttemptError += " (" + unstorable.AttemptError + ")"
		out.Resolves = append(out.Resolves, r)
	}
	return out
}

// dispatchError resolves a failed send through the retry policy (not
// retried at all unless retryable); reached says the request arrived.
func dispatchError(c *store.Claimed, jt *correlator.JobType, r Result, retryable, reached bool) store.Resolve {
	return store.Resolve{Queue: c.Queue, JobID: c.ID, Attempt: c.Attempt, Claim: c.StartedAt, Sent: reached,
		Res: correlator.DispatchFailed(jt, c.Running(), errText(r.Err), retryable, r.RetryAfter, c.DBNow())}
}

func errText(err error) string {
	if err == nil {
		return "dispatch_error"
	}
	return err.Error()
}

func backoff(try int) time.Duration {
	return min(50*time.Millisecond<<min(try, 8), 5*time.Second)
}

package dispatcher_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/dispatcher"
	"github.com/hipq/hipq/internal/localpg"
	"github.com/hipq/hipq/internal/pgtest"
	"github.com/hipq/hipq/store"
)

// outage takes PostgreSQL down after the HTTP sends and brings it back a
// moment later: the deliveries' records meet a database that is gone.
type outage struct {
	t    *testing.T
	pg   *localpg.Cluster
	down chan struct{}
	back chan struct{}
	once sync.Once
}

// httpThenDown sends, then takes PostgreSQL down and starts it again in
// the background. The HTTP type is claimed last, so no claim is cut.
type httpThenDown struct {
	dispatcher.Sender
	o *outage
}

func (s *httpThenDown) Send(ctx context.Context, jobs []store.Claimed) []dispatcher.Result {
	rs := s.Sender.Send(ctx, jobs)
	s.o.once.Do(func() {
		s.o.pg.Down()
		close(s.o.down)
		go func() {
			defer close(s.o.back)
			if err := s.o.pg.Up(context.Background()); err != nil {
				s.o.t.Errorf("restart PostgreSQL: %v", err)
			}
		}()
	})
	return rs
}

// kafkaWhileDown sends, then returns its results only once PostgreSQL is
// down.
type kafkaWhileDown struct {
	dispatcher.Sender
	o *outage
}

func (s *kafkaWhileDown) Send(ctx context.Context, jobs []store.Claimed) []dispatcher.Result {
	rs := s.Sender.Send(ctx, jobs)
	select {
	case <-s.o.down:
	case <-time.After(time.Minute):
		s.o.t.Error("PostgreSQL was never taken down")
	}
	return rs
}

// Issue 9.3: PostgreSQL goes down between the sends and their record, and
// comes back. The
// record (sent_at, sync replies, dispatch errors) is one transaction tried
// again until it lands, so every job ends as its send said: nothing looks
// unsent to the sweeper, no sync reply is lost.
func TestDeliveryRecordSurvivesPostgresRestart(t *testing.T) {
	t.Parallel()
	pg, err := localpg.Start(ctx, localpg.Options{Settings: map[string]string{"synchronous_commit": "on"}})
	if errors.Is(err, localpg.ErrNoServer) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Stop()
	st, err := store.Open(ctx, store.Config{URL: pg.URL("postgres")})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	ds := newDownstream(t, func(key string, n int) (int, string) {
		if strings.HasPrefix(key, "fails") {
			return http.StatusInternalServerError, "busy"
		}
		return http.StatusOK, `{"status": "ok"}`
	})
	_, topic, cl := requestTopic(t)
	retry := &correlator.Backoff{Attempts: 3, Initial: time.Hour, When: []correlator.AttemptOutcome{correlator.AttemptDispatchError}}
	types := map[string]*correlator.JobType{
		"alo":  {Name: "alo", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: correlator.NoRetry},
		"amo":  {Name: "amo", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtMostOnce, Retry: correlator.NoRetry},
		"sync": {Name: "sync", Queue: "default", Timeout: time.Hour, Delivery: correlator.AtLeastOnce, Retry: retry},
	}
	o := &outage{t: t, pg: pg, down: make(chan struct{}), back: make(chan struct{})}
	ks := &kafkaWhileDown{Sender: dispatcher.NewKafkaSender(cl, map[string]dispatcher.KafkaRoute{"alo": {Topic: topic}, "amo": {Topic: topic}}), o: o}
	hs := &httpThenDown{Sender: dispatcher.NewHTTPSender(dispatcher.HTTPSenderConfig{Routes: map[string]dispatcher.HTTPRoute{
		"sync": {URL: ds.URL + "/{job_key}", Sync: true, Timeout: 5 * time.Second}}}), o: o}
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 100,
		Queues: []dispatcher.QueueConfig{{Name: "default"}}, Types: types,
		Senders: map[string]dispatcher.Sender{"alo": ks, "amo": ks, "sync": hs}})
	insert(t, st, "alo", 5)
	insert(t, st, "amo", 5)
	insert(t, st, "sync", 3)
	var jobs []*correlator.Job
	for _, k := range []string{"fails0", "fails1"} {
		jobs = append(jobs, &correlator.Job{Queue: "default", JobType: "sync", JobKey: k, JobData: json.RawMessage(`{}`),
			MaxAttempts: 3, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second)})
	}
	if _, err := st.JobsInsert(ctx, jobs); err != nil {
		t.Fatal(err)
	}
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatalf("round: %v", err)
	}
	// PostgreSQL went down under the sends; the records below landed
	// once it was back (Up returns a moment after it accepts connections,
	// so wait for it rather than race it).
	select {
	case <-o.down:
	default:
		t.Fatal("PostgreSQL never went down under the sends")
	}
	select {
	case <-o.back:
	case <-time.After(time.Minute):
		t.Fatal("PostgreSQL did not come back")
	}
	// Kafka sends: acknowledged, so sent_at, whatever happened after.
	if n := scalar(t, st, `SELECT count(*) FROM hipq_attempt a JOIN hipq_job j ON j.queue = a.queue AND j.id = a.job_id
		WHERE j.job_type IN ('alo', 'amo') AND j.state = 'running' AND a.sent_at IS NOT NULL`); n != 10 {
		t.Fatalf("%d of 10 Kafka sends recorded as sent: the sweeper would undo (alo) or fail (amo) the others", n)
	}
	// Sync replies: applied.
	if n := scalar(t, st, `SELECT count(*) FROM hipq_job WHERE job_type = 'sync' AND state = 'final' AND outcome = 'succeeded'`); n != 3 {
		t.Fatalf("%d of 3 sync replies applied", n)
	}
	// 500s: dispatch errors through the retry policy, the call recorded as sent.
	if n := scalar(t, st, `SELECT count(*) FROM hipq_job j JOIN hipq_attempt a ON a.queue = j.queue AND a.job_id = j.id
		WHERE j.job_key LIKE 'fails%' AND j.state = 'retry' AND a.outcome = 'dispatch_error' AND a.sent_at IS NOT NULL`); n != 2 {
		t.Fatalf("%d of 2 failed calls recorded", n)
	}
}

// Issue 9.4: once a claim commits, nothing after it keeps its jobs from
// their deliveries: a job whose time windows this build cannot read, and
// a reschedule of closed jobs that PostgreSQL refuses, leave every other
// claimed job sent and recorded.
func TestBookkeepingFailureAfterClaimStrandsNothing(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	st := pgtest.New(t)
	_, topic, cl := requestTopic(t)
	insert(t, st, "alo", 4)
	// PostgreSQL reads this zone as always open; Go cannot load it.
	if _, err := st.Pool().Exec(ctx, `UPDATE hipq_job SET time_windows = '[{"start":"00:00","end":"00:00","tz":"Mars/Olympus_Mons"}]'
		WHERE job_key = 'alo0'`); err != nil {
		t.Fatal(err)
	}
	// A job outside its window, whose reschedule PostgreSQL refuses.
	now := time.Now().UTC()
	closed := []correlator.TimeWindow{{Start: now.Add(2 * time.Hour).Format("15:04"), End: now.Add(3 * time.Hour).Format("15:04")}}
	if _, err := st.JobsInsert(ctx, []*correlator.Job{{Queue: "default", JobType: "alo", JobKey: "closed", JobData: json.RawMessage(`{}`),
		MaxAttempts: 1, Priority: 100, ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: now.Add(-time.Minute), TimeWindows: closed}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, `
		CREATE FUNCTION refuse_defer() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'no reschedules today'; END $$;
		CREATE TRIGGER refuse_defer BEFORE UPDATE ON hipq_job FOR EACH ROW
		WHEN (OLD.job_key = 'closed' AND OLD.state = NEW.state) EXECUTE FUNCTION refuse_defer();`); err != nil {
		t.Fatal(err)
	}
	d, _ := newDispatcher(t, st, cl, topic)
	_, err := d.RunOnce(ctx)
	if err == nil || !strings.Contains(err.Error(), "no reschedules today") {
		t.Fatalf("round error %v, want the refused reschedule", err)
	}
	if n := scalar(t, st, `SELECT count(*) FROM hipq_job j JOIN hipq_attempt a ON a.queue = j.queue AND a.job_id = j.id
		WHERE j.state = 'running' AND a.sent_at IS NOT NULL`); n != 4 {
		t.Fatalf("%d of 4 claimed jobs sent and recorded", n)
	}
	if n := scalar(t, st, `SELECT count(*) FROM hipq_job WHERE job_key = 'closed' AND state = 'initial' AND attempt = 0`); n != 1 {
		t.Fatalf("the closed job moved")
	}
}

// Issue 9.12: a record in flight when the producer closes may have been
// written: an at_most_once job is never sent again (final / failed), an
// at_least_once one is undone to be sent again.
func TestProducerClosedIsNotARefusal(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	_, topic, cl := requestTopic(t)
	insert(t, st, "alo", 2)
	insert(t, st, "amo", 2)
	cl.Close()
	d, m := newDispatcher(t, st, cl, topic)
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if n := scalar(t, st, `SELECT count(*) FROM hipq_job WHERE job_type = 'amo' AND state = 'final' AND outcome = 'failed'
		AND error LIKE 'request may have been delivered%'`); n != 2 {
		t.Fatalf("%d of 2 at_most_once jobs ended failed; one re-sent could be delivered twice", n)
	}
	if n := scalar(t, st, `SELECT count(*) FROM hipq_job WHERE job_type = 'alo' AND state = 'initial' AND attempt = 0`); n != 2 {
		t.Fatalf("%d of 2 at_least_once jobs undone", n)
	}
	if v, _ := m.Value("hipq_dispatches_total", map[string]string{"result": "unknown"}); v != 4 {
		t.Fatalf("%v sends counted unknown, want 4", v)
	}
}

// Issue 9.6: a record too large for the topic can never be written: the
// job ends final / failed at its first attempt, saying why and where, and
// its retry policy is not burned.
func TestRecordTooLargeEndsAtOnce(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	k, topic, _ := requestTopic(t)
	cl := k.Client(append(dispatcher.KafkaProducerOpts(), kgo.ProducerBatchMaxBytes(2000))...)
	defer cl.Close()
	s := dispatcher.NewKafkaSender(cl, map[string]dispatcher.KafkaRoute{"big": {Topic: topic}})
	retry := &correlator.Backoff{Attempts: 5, Initial: time.Millisecond, When: []correlator.AttemptOutcome{correlator.AttemptDispatchError}}
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", Queues: []dispatcher.QueueConfig{{Name: "default"}},
		Types:   map[string]*correlator.JobType{"big": {Name: "big", Queue: "default", Timeout: time.Hour, Retry: retry}},
		Senders: map[string]dispatcher.Sender{"big": s}})
	if _, err := st.JobsInsert(ctx, []*correlator.Job{{Queue: "default", JobType: "big", JobKey: "b", MaxAttempts: 5, Priority: 100,
		ThrottleFactor: 1, TimeoutSeconds: 3600, ScheduledRunTime: time.Now().Add(-time.Second),
		JobData: json.RawMessage(`"` + strings.Repeat("x", 5000) + `"`)}}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	j, err := st.JobGet(ctx, "big", "b")
	if err != nil {
		t.Fatal(err)
	}
	want(t, j, correlator.StateFinal, correlator.OutcomeFailed, 1)
	if !strings.Contains(j.Error, topic) || !strings.Contains(j.Error, "MESSAGE_TOO_LARGE") {
		t.Fatalf("error %q does not name the topic and the refusal", j.Error)
	}
}

// Issue 9.10 and 9.16: every HTTP call the downstream answered, whatever
// its status, reached the service and records sent_at; a refused
// connection did not. No stored error shows a secret of the URL.
func TestHTTPAnsweredCallsAreSentAndURLsRedacted(t *testing.T) {
	t.Parallel()
	ds := newDownstream(t, func(key string, n int) (int, string) {
		switch key {
		case "e500":
			return http.StatusInternalServerError, "down"
		case "e422":
			return http.StatusUnprocessableEntity, "bad"
		}
		return http.StatusAccepted, ""
	})
	secretURL := strings.Replace(ds.URL, "http://", "http://user:pa55word@", 1) + "/calls/{job_key}?api_key=T0PSECRET&x=1"
	c := newHTTPCase(t, secretURL, 5*time.Second)
	for _, k := range []string{"e500", "e422"} {
		c.insert("sync", k)
	}
	for _, k := range []string{"e500", "e422"} {
		c.settle("sync", k)
	}
	if n := scalar(t, c.st, `SELECT count(*) FROM hipq_attempt WHERE outcome = 'dispatch_error' AND sent_at IS NOT NULL`); n < 2 {
		t.Fatalf("%d answered calls recorded as sent, want every one", n)
	}
	if n := scalar(t, c.st, `SELECT count(*) FROM hipq_attempt WHERE sent_at IS NULL`); n != 0 {
		t.Fatalf("%d answered calls without sent_at", n)
	}
	// A refused connection: no sent_at, and the error still redacted.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://user:pa55word@" + l.Addr().String() + "/x?api_key=T0PSECRET"
	l.Close()
	c2 := newHTTPCase(t, dead, 100*time.Millisecond)
	c2.insert("sync", "refused")
	j := c2.settle("sync", "refused")
	for j.State != correlator.StateFinal {
		j = c2.settle("sync", "refused")
	}
	if n := scalar(t, c2.st, `SELECT count(*) FROM hipq_attempt WHERE sent_at IS NOT NULL`); n != 0 {
		t.Fatalf("%d refused calls recorded as sent", n)
	}
	for _, st := range []*store.Store{c.st, c2.st} {
		if n := scalar(t, st, `SELECT count(*) FROM (SELECT error FROM hipq_job UNION ALL SELECT error FROM hipq_attempt) e
			WHERE error LIKE '%pa55word%' OR error LIKE '%T0PSECRET%'`); n != 0 {
			t.Fatalf("%d stored errors hold a secret of the URL", n)
		}
	}
	if !strings.Contains(j.Error, "api_key=REDACTED") || !strings.Contains(j.Error, "connection refused") {
		t.Fatalf("error %q", j.Error)
	}
}

// A delivery record PostgreSQL refuses for good (here a trigger; in life a
// reply or text it cannot take) is recorded job by job: the other jobs'
// records land, a job whose reply is refused ends failed saying so, and a
// job whose every record is refused is left to the sweeper, with no
// endless retry.
func TestRefusedRecordIsRecordedJobByJob(t *testing.T) {
	pgtest.SkipOnCitus(t, "the test makes PostgreSQL refuse writes with a trigger, which Citus does not run on a distributed table")
	t.Parallel()
	st := pgtest.New(t)
	ds := newDownstream(t, func(string, int) (int, string) { return http.StatusOK, `{"status": "ok"}` })
	c := newHTTPCaseOn(t, st, ds.URL, 5*time.Second)
	for _, k := range []string{"ok1", "ok2", "cursed", "doomed"} {
		c.insert("sync", k)
	}
	if _, err := st.Pool().Exec(ctx, `
		CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused for %', NEW.job_key USING ERRCODE = 'XX000'; END $$;
		CREATE TRIGGER refuse BEFORE UPDATE ON hipq_job FOR EACH ROW
		WHEN ((NEW.job_key = 'cursed' AND NEW.result IS NOT NULL) OR (NEW.job_key = 'doomed' AND OLD.state = 'running'))
		EXECUTE FUNCTION refuse();`); err != nil {
		t.Fatal(err)
	}
	_, err := c.d.RunOnce(ctx)
	if err == nil || !strings.Contains(err.Error(), "refused for doomed") {
		t.Fatalf("round: %v, want the doomed job's record refused", err)
	}
	for _, k := range []string{"ok1", "ok2"} {
		j, _ := st.JobGet(ctx, "sync", k)
		want(t, j, correlator.StateFinal, correlator.OutcomeSucceeded, 1)
	}
	j, _ := st.JobGet(ctx, "sync", "cursed")
	want(t, j, correlator.StateFinal, correlator.OutcomeFailed, 1)
	if !strings.Contains(j.Error, "the reply could not be stored") {
		t.Fatalf("cursed: error %q", j.Error)
	}
	j, _ = st.JobGet(ctx, "sync", "doomed")
	want(t, j, correlator.StateRunning, "", 1)
}

// overtaken sends nothing: while its sends are "in flight", the sweeper
// takes their claims for lost and undoes them, and another instance
// claims the jobs again, under the same attempt numbers. Then it returns
// what it was told each send became.
type overtaken struct {
	t      *testing.T
	st     *store.Store
	status map[string]dispatcher.Result
	again  []store.Claimed
}

func (s *overtaken) Transport() string             { return "stub" }
func (s *overtaken) Route(string) dispatcher.Route { return dispatcher.Route{Neighbour: "stub"} }
func (s *overtaken) Send(ctx context.Context, jobs []store.Claimed) []dispatcher.Result {
	refs := make([]store.AttemptRef, len(jobs))
	for i := range jobs {
		refs[i] = jobs[i].Ref()
	}
	if n, err := s.st.JobUndoClaim(ctx, refs); err != nil || n != len(jobs) {
		s.t.Errorf("the rescue undid %d of %d claims: %v", n, len(jobs), err)
	}
	c, err := s.st.JobClaim(ctx, store.JobClaimParams{Queue: "default", Limit: 100, Instance: "other"})
	if err != nil {
		s.t.Error(err)
	}
	s.again = c.Jobs
	out := make([]dispatcher.Result, len(jobs))
	for i, j := range jobs {
		out[i] = s.status[j.JobKey]
	}
	return out
}

// A delivery recorded after its claims were undone and made again (same
// attempt numbers) moves none of the new claims: each outcome of the
// dispatcher's record names the claim it is about.
func TestLateRecordLeavesTheNextClaimAlone(t *testing.T) {
	t.Parallel()
	st := pgtest.New(t)
	s := &overtaken{t: t, st: st, status: map[string]dispatcher.Result{
		"alo0": {Status: dispatcher.Sent},
		"alo1": {Status: dispatcher.NotSent, Err: errors.New("never left")},
		"alo2": {Status: dispatcher.Failed, Final: true, Err: errors.New("rejected")},
		"alo3": {Status: dispatcher.Unknown, Err: errors.New("may have arrived")},
	}}
	tys := types()
	tys["alo"].Delivery = correlator.AtMostOnce // an unknown outcome then ends the attempt
	d := dispatcher.New(zaptest.NewLogger(t), st, dispatcher.Config{Instance: "test", BatchSize: 100,
		Queues: []dispatcher.QueueConfig{{Name: "default"}}, Types: tys, Senders: map[string]dispatcher.Sender{"alo": s}})
	insert(t, st, "alo", 4)
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatalf("round: %v", err)
	}
	if len(s.again) != 4 {
		t.Fatalf("claimed again %d of 4", len(s.again))
	}
	for _, c := range s.again {
		j, err := st.JobGet(ctx, "alo", c.JobKey)
		if err != nil {
			t.Fatal(err)
		}
		want(t, j, correlator.StateRunning, "", 1)
	}
	if n := scalar(t, st, `SELECT count(*) FROM hipq_attempt WHERE sent_at IS NULL AND outcome IS NULL AND instance = 'other'`); n != 4 {
		t.Fatalf("%d of the 4 new claims' attempts left unsent and open", n)
	}
}

package store

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/puddle/v2"
)

// The channels hipq NOTIFYs on. Their names are written here and in the
// migration that installs the outbox's trigger, nowhere else.
const (
	// channelJobReady: a job became due or left running (a new job, a
	// throttle slot freed, an end); the payload is its queue.
	channelJobReady = "hipq_job_ready"
	// channelIntake: rows were committed to the outbox hipq_intake (by
	// its trigger, 0004_outbox.sql).
	channelIntake = "hipq_intake"
	// channelEvent: outcome events were committed to hipq_event (by its
	// trigger, schemas/repeatable/hipq_event_notify.sql).
	channelEvent = "hipq_event"
)

// WaitJobReady calls wake at each notice that a job became due or left
// running, and each time it starts listening (notices sent before are
// lost, so look then too), until ctx ends or the store closes. A notice is
// a hint: callers poll too. A lost connection is reported to failed and
// listened again a second later.
func (s *Store) WaitJobReady(ctx context.Context, wake func(), failed func(error)) {
	s.listen(ctx, channelJobReady, func(string) { wake() }, failed)
}

// WaitIntake is WaitJobReady for rows committed to the outbox.
func (s *Store) WaitIntake(ctx context.Context, wake func(), failed func(error)) {
	s.listen(ctx, channelIntake, func(string) { wake() }, failed)
}

// WaitEvents is WaitJobReady for outcome events committed: wake gets the
// topics a notice names (those the committed statement wrote events to),
// or nil when every topic should be looked at (as it starts listening, or
// for a notice that names none: too many topics to name, or sent by an
// older version).
func (s *Store) WaitEvents(ctx context.Context, wake func(topics []string), failed func(error)) {
	s.listen(ctx, channelEvent, func(payload string) {
		if payload == "" {
			wake(nil)
			return
		}
		wake(strings.Split(payload, ","))
	}, failed)
}

// listen holds one connection of the pool LISTENing on channel while ctx
// lasts; on Citus, one on each other node of the cluster too
// (listenOtherNodes).
func (s *Store) listen(ctx context.Context, channel string, wake func(payload string), failed func(error)) {
	if s.dist {
		ctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.listenOtherNodes(ctx, channel, wake, failed)
		}()
		defer func() { cancel(); <-done }()
	}
	for ctx.Err() == nil {
		err := func() error {
			conn, err := s.pool.Acquire(ctx)
			if err != nil {
				return err
			}
			defer conn.Release()
			defer conn.Exec(context.WithoutCancel(ctx), "UNLISTEN *") //nolint:errcheck // only a broken connection fails it, and its LISTEN went with it
			return listenOn(ctx, conn.Conn(), channel, wake)
		}()
		if ctx.Err() != nil || errors.Is(err, puddle.ErrClosedPool) {
			return
		}
		failed(err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// listenOn LISTENs on channel on conn and calls wake once listening (a
// notice sent before is lost, so look then too: with an empty payload)
// and at each notice, with its payload, until conn or ctx fails.
func listenOn(ctx context.Context, conn *pgx.Conn, channel string, wake func(payload string)) error {
	if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
		return err
	}
	wake("")
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		wake(n.Payload)
	}
}

package api

import (
	"context"
	"net/http"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
)

// MaxWait caps a long poll: the client asks again for longer.
const MaxWait = 60 * time.Second

// waitParams reads ?job_id= and ?wait= of GET /v1/jobs/{type}/{key}.
func waitParams(r *http.Request) (id int64, wait time.Duration, err error) {
	q := r.URL.Query()
	for k := range q {
		if k != "job_id" && k != "wait" {
			return 0, 0, errorf(http.StatusBadRequest, "invalid_parameter", "%s: unknown parameter (job_id, wait)", correlator.Clip(k, 64))
		}
	}
	if v := q.Get("job_id"); v != "" {
		if id, err = strconv.ParseInt(v, 10, 64); err != nil || id <= 0 {
			return 0, 0, errorf(http.StatusBadRequest, "invalid_parameter", "job_id: %q is not a job id", correlator.Clip(v, 64))
		}
	}
	if v := q.Get("wait"); v != "" {
		if wait, err = time.ParseDuration(v); err != nil || wait < 0 {
			return 0, 0, errorf(http.StatusBadRequest, "invalid_parameter", "wait: %q is not a duration such as 30s", correlator.Clip(v, 64))
		}
		if id == 0 {
			return 0, 0, errorf(http.StatusBadRequest, "invalid_parameter",
				"wait: needs job_id (a key is reused once its job is final, so a wait names the job)")
		}
	}
	return id, min(wait, MaxWait), nil
}

// waitFinal long-polls until the job load returns is final, wait passes, or
// the caller leaves. The hub wakes it when the job is final (it looks at
// every NOTIFY of a job ending or leaving running, and at least every second, for all
// the waits at once); each look is bounded by the request timeout. It
// returns the job as last seen.
func (s *Server) waitFinal(r *http.Request, j *correlator.Job, wait time.Duration,
	load func(context.Context) (*correlator.Job, error)) (*correlator.Job, error) {
	base, _ := r.Context().Value(requestCtxKey{}).(context.Context)
	if base == nil {
		base = r.Context()
	}
	ctx, cancel := context.WithTimeout(base, wait)
	defer cancel()
	for j.State != correlator.StateFinal {
		ended, leave := s.hub.join(s, j.ID)
		select {
		case <-ctx.Done():
			leave()
			result := "timeout"
			if base.Err() != nil {
				result = "gone"
			}
			s.cfg.Metrics.Waits.WithLabelValues(result).Inc()
			return j, nil
		case <-ended:
		}
		leave()
		lctx, lcancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		next, err := load(lctx)
		lcancel()
		if err != nil {
			if ctx.Err() != nil {
				continue // the wait ended during the look: answer with what was seen
			}
			return nil, err
		}
		j = next
	}
	s.cfg.Metrics.Waits.WithLabelValues("final").Inc()
	return j, nil
}

// hub wakes the waits whose job is final (or gone). While at least one
// wait is under way it LISTENs for hipq_job_ready (a job left running) on
// one connection of the API's pool and, at each notice and at least every
// second, asks PostgreSQL once which of the waited jobs are final; it gives
// the connection back when the last wait ends, so closing the pool never
// waits on it.
type hub struct {
	mu    sync.Mutex
	waits map[int64][]chan struct{}
	n     int
	stop  context.CancelFunc
	dirty chan struct{} // look now
}

// join registers a wait for job id: ended is closed once the job is final
// or gone; leave must be called after.
func (h *hub) join(s *Server, id int64) (ended <-chan struct{}, leave func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.waits == nil {
		h.waits = map[int64][]chan struct{}{}
	}
	ch := make(chan struct{})
	h.waits[id] = append(h.waits[id], ch)
	h.n++
	if h.n == 1 {
		// A listener and checker of their own, with their own pokes: the
		// previous ones may still be stopping.
		ctx, stop := context.WithCancel(context.Background())
		h.stop = stop
		h.dirty = make(chan struct{}, 1)
		go h.listen(ctx, s, h.dirty)
		go h.check(ctx, s, h.dirty)
	}
	poke(h.dirty) // the job may have ended since it was read
	return ch, func() { h.leave(id, ch) }
}

func (h *hub) leave(id int64, ch chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	chs := h.waits[id]
	for i, c := range chs {
		if c == ch {
			chs = append(chs[:i], chs[i+1:]...)
			break
		}
	}
	if len(chs) == 0 {
		delete(h.waits, id)
	} else {
		h.waits[id] = chs
	}
	h.n--
	if h.n == 0 {
		h.stop()
	}
}

// poke asks a checker to look now.
func poke(dirty chan struct{}) {
	select {
	case dirty <- struct{}{}:
	default:
	}
}

// check looks which waited jobs ended, once per poke or second.
func (h *hub) check(ctx context.Context, s *Server, dirty chan struct{}) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-dirty:
		case <-tick.C:
		}
		h.mu.Lock()
		ids := make([]int64, 0, len(h.waits))
		for id := range h.waits {
			ids = append(ids, id)
		}
		h.mu.Unlock()
		if len(ids) == 0 {
			continue
		}
		qctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		ended, err := s.st.JobsEnded(qctx, ids)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				s.log.Debug("look for ended jobs failed; again within a second", zap.Error(err))
			}
			continue
		}
		h.mu.Lock()
		for _, id := range ended {
			for _, ch := range h.waits[id] {
				close(ch)
			}
			delete(h.waits, id) // n counts on: each wait leaves
		}
		h.mu.Unlock()
		select { // under load notices come back to back: one look per 20 ms at most
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (h *hub) listen(ctx context.Context, s *Server, dirty chan struct{}) {
	s.st.WaitJobReady(ctx, func() { poke(dirty) }, func(err error) {
		s.log.Debug("listen for finished jobs failed; waits look every second meanwhile", zap.Error(err))
	})
}

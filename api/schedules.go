package api

import (
	"context"
	"errors"
	"net/http"
	"time"

	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
)

// scheduleJSON is a schedule as the API shows it.
type scheduleJSON struct {
	Name          string     `json:"name"`
	Cron          string     `json:"cron"`
	TZ            string     `json:"tz"`
	JobType       string     `json:"job_type"`
	CatchUp       string     `json:"catch_up"`
	CatchUpWindow string     `json:"catch_up_window"`
	Overlap       string     `json:"overlap"`
	Paused        bool       `json:"paused"`
	LastFire      *time.Time `json:"last_fire"`
	NextFire      *time.Time `json:"next_fire"`
	LastJobKey    string     `json:"last_job_key,omitempty"`
}

func (s *Server) schedule(name string) (*correlator.Schedule, error) {
	for _, sc := range s.cfg.Schedules {
		if sc.Name == name {
			return sc, nil
		}
	}
	return nil, errorf(http.StatusNotFound, "not_found", "schedule %q is not configured", name)
}

// listSchedules: GET /v1/schedules: every configured schedule, its state
// and its next tick.
func (s *Server) listSchedules(w http.ResponseWriter, r *http.Request) error {
	out, err := s.scheduleList(r.Context())
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"schedules": out})
	return nil
}

// scheduleList is every configured schedule with its state and next tick.
func (s *Server) scheduleList(ctx context.Context) ([]scheduleJSON, error) {
	states, _, err := s.st.ScheduleStates(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]scheduleJSON, 0, len(s.cfg.Schedules))
	for _, sc := range s.cfg.Schedules {
		j := scheduleJSON{Name: sc.Name, Cron: sc.Cron, TZ: sc.Zone.String(), JobType: sc.JobType, CatchUp: string(sc.CatchUp),
			CatchUpWindow: sc.CatchUpWindow.String(), Overlap: string(sc.Overlap)}
		if st, ok := states[sc.Name]; ok { // no row yet: no sweeper has looked at it
			last, next := st.LastFire, sc.Next(st.LastFire)
			j.Paused, j.LastFire, j.LastJobKey = st.Paused, &last, st.LastJobKey
			if !next.IsZero() {
				j.NextFire = &next
			}
		}
		out = append(out, j)
	}
	return out, nil
}

// withRow runs fn on a configured schedule, making its row first when no
// sweeper has yet.
func (s *Server) withRow(r *http.Request, fn func(*correlator.Schedule) error) error {
	sc, err := s.schedule(r.PathValue("name"))
	if err != nil {
		return err
	}
	err = fn(sc)
	if errors.Is(err, correlator.ErrNotFound) {
		if err := s.st.ScheduleSync(r.Context(), []string{sc.Name}); err != nil {
			return err
		}
		err = fn(sc)
	}
	return err
}

// pauseSchedule: POST /v1/schedules/{name}/pause and …/resume. Ticks due
// while paused are passed over.
func (s *Server) pauseSchedule(paused bool) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		return s.withRow(r, func(sc *correlator.Schedule) error {
			if err := s.st.ScheduleSetPaused(r.Context(), sc.Name, paused); err != nil {
				return err
			}
			s.log.Info("schedule paused or resumed", zap.String("schedule", sc.Name), zap.Bool("paused", paused))
			writeJSON(w, http.StatusOK, map[string]any{"schedule": sc.Name, "paused": paused})
			return nil
		})
	}
}

// triggerSchedule: POST /v1/schedules/{name}/trigger: the schedule's job
// now, its key rendered for now; the timetable does not move. 201 with a
// new job, 200 when a non-final job had that key.
func (s *Server) triggerSchedule(w http.ResponseWriter, r *http.Request) error {
	return s.withRow(r, func(sc *correlator.Schedule) error {
		jt, err := s.jobType(sc.JobType)
		if err != nil {
			return err
		}
		key, created, err := s.st.ScheduleTrigger(r.Context(), sc, jt)
		if errors.As(err, new(*correlator.InputError)) {
			return errorf(http.StatusUnprocessableEntity, correlator.CodeInvalidField, "schedule %s: %v", sc.Name, err)
		}
		if err != nil {
			return err
		}
		s.cfg.Metrics.ScheduleFires.WithLabelValues(sc.Name, map[bool]string{true: "enqueued", false: "duplicate"}[created]).Inc()
		s.log.Info("schedule triggered", zap.String("schedule", sc.Name), zap.String("job_key", key), zap.Bool("created", created))
		status := http.StatusOK
		if created {
			status = http.StatusCreated
		}
		writeJSON(w, status, map[string]any{"schedule": sc.Name, "job_type": sc.JobType, "job_key": key, "created": created})
		return nil
	})
}

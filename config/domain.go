package config

import (
	"fmt"
	"net/url"
	"reflect"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/hipq/hipq/correlator"
)

// Queue returns the named queue, or nil.
func (c *Config) Queue(name string) *Queue {
	for i := range c.Queues {
		if c.Queues[i].Name == name {
			return &c.Queues[i]
		}
	}
	return nil
}

// shares returns the queue's share caps, nil when it has none (or they are
// invalid, which Validate reports).
func (q *Queue) shares() *correlator.Shares {
	if q.Shares == nil {
		return nil
	}
	s, err := correlator.NewShares(q.Shares.By.JSON, q.Shares.Weights, q.ThrottleLimit)
	if err != nil {
		return nil
	}
	return s
}

// rate builds a rate; key names it durably (its units in PostgreSQL).
func (r Rate) rate(key, jobType string) (correlator.Rate, error) {
	var by string
	if r.By != nil {
		if r.By.JSON == "" || r.By.Header != "" {
			return correlator.Rate{}, fmt.Errorf("by: must be {json: /pointer} into job_data")
		}
		by = r.By.JSON
	}
	return correlator.NewRate(key, r.Limit, r.Period.D(), jobType, by)
}

// Throttles returns every queue's throttle, by queue name.
func (c *Config) Throttles() map[string]*correlator.Throttle {
	out := map[string]*correlator.Throttle{}
	for i := range c.Queues {
		q := &c.Queues[i]
		out[q.Name] = &correlator.Throttle{Limit: q.ThrottleLimit, Shares: q.shares()}
		for k, r := range q.Rates {
			if cr, err := r.rate(fmt.Sprintf("q:%s#%d", q.Name, k), ""); err == nil {
				out[q.Name].Rates = append(out[q.Name].Rates, cr)
			}
		}
	}
	for _, jt := range c.JobTypes {
		t := out[jt.Queue]
		if t == nil {
			continue
		}
		for k, r := range jt.Rates {
			if cr, err := r.rate(fmt.Sprintf("t:%s#%d", jt.Name, k), jt.Name); err == nil {
				t.Rates = append(t.Rates, cr)
			}
		}
		if jt.Critical {
			t.Critical = append(t.Critical, jt.Name)
		}
		if jt.MaxConcurrency > 0 {
			if t.MaxConcurrency == nil {
				t.MaxConcurrency = map[string]int{}
			}
			t.MaxConcurrency[jt.Name] = jt.MaxConcurrency
		}
	}
	return out
}

// Domain maps the job types onto the correlator's, by name.
func (c *Config) Domain() correlator.Types {
	out := make(correlator.Types, len(c.JobTypes))
	for i := range c.JobTypes {
		jt := &c.JobTypes[i]
		d := &correlator.JobType{
			Name:           jt.Name,
			Queue:          jt.Queue,
			Timeout:        jt.Timeout.D(),
			Priority:       *jt.Priority,
			ThrottleFactor: jt.ThrottleFactor,
			Delivery:       jt.Delivery,
			Retry:          correlator.NoRetry,
			Windows:        append([]correlator.TimeWindow(nil), jt.TimeWindows...),
		}
		_ = correlator.CompileWindows(d.Windows)
		d.Critical, d.MaxConcurrency = jt.Critical, jt.MaxConcurrency
		d.HeartbeatTimeout, d.MaxTimeout = jt.HeartbeatTimeout.D(), jt.MaxTimeout.D()
		if jt.dataSchema != nil {
			d.CheckData = jt.dataSchema.Check
		}
		if e := jt.Events; e != nil && len(e.On) > 0 {
			d.Events = correlator.Events{Topic: e.Topic, Attempts: slices.Contains(e.On, correlator.EventsOnAttempt)}
		}
		d.AllowedReplyTo = slices.Clone(c.Events.AllowedReplyTo)
		if h := jt.Transport.HTTP; h != nil {
			d.SendTimeout = h.Timeout.D() // Kafka types: the record delivery timeout, the default
		}
		if q := c.Queue(jt.Queue); q != nil {
			d.QueueLimit = q.ThrottleLimit
			d.Shares = q.shares()
		}
		if r := jt.Retry; r != nil {
			b := &correlator.Backoff{
				Attempts:    r.MaxAttempts,
				Exponential: r.Backoff == "exponential",
				Initial:     r.Initial.D(),
				Multiplier:  r.Multiplier,
				Max:         r.Max.D(),
				Jitter:      *r.Jitter,
			}
			for _, w := range r.When {
				o, _ := correlator.ParseAttemptOutcome(w)
				b.When = append(b.When, o)
			}
			d.Retry = b
		}
		out[jt.Name] = d
	}
	return out
}

// PeriodicJobs returns the compiled schedules (after Validate).
func (c *Config) PeriodicJobs() []*correlator.Schedule {
	out := make([]*correlator.Schedule, 0, len(c.Schedules))
	for i := range c.Schedules {
		if s := c.Schedules[i].compiled; s != nil {
			out = append(out, s)
		}
	}
	return out
}

// Matcher builds the matcher of a response topic: its fields over the
// defaults.
func (rt *ResponseTopic) Matcher(maxBytes int) correlator.Matcher {
	m := correlator.DefaultMatcher()
	m.MaxBytes = maxBytes
	set := func(dst *correlator.Field, src *correlator.Field) {
		if src != nil {
			*dst = *src
		}
	}
	set(&m.JobID, rt.JobID)
	set(&m.JobType, rt.JobType)
	set(&m.JobKey, rt.JobKey)
	set(&m.Attempt, rt.Attempt)
	set(&m.Retryable, rt.Retryable)
	set(&m.RetryAfter, rt.RetryAfter)
	set(&m.Error, rt.Error)
	set(&m.Result, rt.Result)
	if s := rt.Status; s != nil {
		m.Status = s.Field
		if s.Success != nil {
			m.Success = s.Success
		}
		if s.Failure != nil {
			m.Failure = s.Failure
		}
		if s.Progress != nil {
			m.Progress = s.Progress
		}
	}
	return m
}

// Redacted is the effective config as YAML with every secret replaced:
// fields tagged secret, and the password of the database URL.
func (c *Config) Redacted() string {
	cp := *c
	redact(reflect.ValueOf(&cp).Elem())
	b, err := yaml.Marshal(&cp)
	if err != nil {
		return "# cannot print config: " + err.Error()
	}
	return string(b)
}

const hidden = "REDACTED"

// redact replaces secrets in v, copying what it changes so the original
// config is left alone.
func redact(v reflect.Value) {
	switch v.Kind() {
	case reflect.Pointer:
		if !v.IsNil() {
			cp := reflect.New(v.Elem().Type())
			cp.Elem().Set(v.Elem())
			redact(cp.Elem())
			v.Set(cp)
		}
	case reflect.Slice:
		if !v.IsNil() {
			cp := reflect.MakeSlice(v.Type(), v.Len(), v.Len())
			reflect.Copy(cp, v)
			for i := range cp.Len() {
				redact(cp.Index(i))
			}
			v.Set(cp)
		}
	case reflect.Struct:
		t := v.Type()
		for i := range t.NumField() {
			f := t.Field(i)
			if !f.IsExported() {
				continue
			}
			fv := v.Field(i)
			switch f.Tag.Get("secret") {
			case "true":
				hideAll(fv)
			case "url":
				fv.SetString(redactURL(fv.String()))
			default:
				redact(fv)
			}
		}
	}
}

func hideAll(v reflect.Value) {
	switch v.Kind() {
	case reflect.String:
		if v.String() != "" {
			v.SetString(hidden)
		}
	case reflect.Slice:
		if !v.IsNil() {
			cp := reflect.MakeSlice(v.Type(), v.Len(), v.Len())
			for i := range cp.Len() {
				cp.Index(i).SetString(hidden)
			}
			v.Set(cp)
		}
	case reflect.Map:
		if !v.IsNil() {
			cp := reflect.MakeMap(v.Type())
			for _, k := range v.MapKeys() {
				cp.SetMapIndex(k, reflect.ValueOf(hidden))
			}
			v.Set(cp)
		}
	}
}

// secretParams are the connection parameters that hold a secret: the
// password, and the one that decrypts a client key (sslpassword).
var secretParams = []string{"password", "sslpassword"}

// redactURL hides the secrets of a URL or of a key=value connection string
// (libpq's: values may be single-quoted, with backslash escapes).
func redactURL(s string) string {
	if u, err := url.Parse(s); err == nil && u.Scheme != "" {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), hidden)
		}
		q := u.Query()
		changed := false
		for _, k := range secretParams {
			if q.Has(k) {
				q.Set(k, hidden)
				changed = true
			}
		}
		if changed {
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		if s[i] == ' ' || s[i] == '\t' || s[i] == '\n' {
			b.WriteByte(s[i])
			i++
			continue
		}
		// A key, an '=' (spaces around it allowed), then a value, bare or quoted.
		j := i
		for j < len(s) && s[j] != '=' && s[j] != ' ' && s[j] != '\t' && s[j] != '\n' {
			j++
		}
		key := s[i:j]
		k := j
		for k < len(s) && (s[k] == ' ' || s[k] == '\t' || s[k] == '\n') {
			k++
		}
		if k >= len(s) || s[k] != '=' || key == "" {
			b.WriteString(s[i:min(k+1, len(s))])
			i = k + 1
			continue
		}
		k++
		for k < len(s) && (s[k] == ' ' || s[k] == '\t' || s[k] == '\n') {
			k++
		}
		v := k
		if v < len(s) && s[v] == '\'' {
			v++
			for v < len(s) && s[v] != '\'' {
				if s[v] == '\\' {
					v++
				}
				v++
			}
			v = min(v+1, len(s))
		} else {
			for v < len(s) && s[v] != ' ' && s[v] != '\t' && s[v] != '\n' {
				v++
			}
		}
		if slices.Contains(secretParams, key) {
			b.WriteString(s[i:k] + hidden)
		} else {
			b.WriteString(s[i:v])
		}
		i = v
	}
	return b.String()
}

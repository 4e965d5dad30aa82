package consumer

import "sync"

// counters count what a consumer did; safe to read while it runs.
type counters struct {
	mu sync.Mutex
	m  map[string]int64
}

func (c *counters) add(name string, n int64) {
	if n == 0 {
		return
	}
	c.mu.Lock()
	if c.m == nil {
		c.m = map[string]int64{}
	}
	c.m[name] += n
	c.mu.Unlock()
}

func (c *counters) snapshot() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int64, len(c.m))
	for k, v := range c.m {
		out[k] = v
	}
	return out
}

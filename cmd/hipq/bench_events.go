package main

import (
	"context"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// lastEventProduced is when the last event of topic was produced: the
// latest timestamp of the last record of each of its partitions, which
// the relay's client sets as it produces the record. It also returns how
// many records the topic holds.
//
// A run with events ends there, timed by the data as a run without events
// is (its jobs' update_time), rather than by the scrape that saw the last
// event counted, which comes up to its interval later.
func lastEventProduced(ctx context.Context, brokers []string, topic string) (time.Time, int64, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return time.Time{}, 0, err
	}
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListEndOffsets(ctx, topic)
	if err != nil {
		return time.Time{}, 0, fmt.Errorf("end offsets of %s: %w", topic, err)
	}
	if err := ends.Error(); err != nil {
		return time.Time{}, 0, fmt.Errorf("end offsets of %s: %w", topic, err)
	}
	from := map[int32]kgo.Offset{}
	var total int64
	ends.Each(func(o kadm.ListedOffset) {
		total += o.Offset
		if o.Offset > 0 {
			from[o.Partition] = kgo.NewOffset().At(o.Offset - 1)
		}
	})
	if len(from) == 0 {
		return time.Time{}, 0, fmt.Errorf("no record in %s", topic)
	}
	last := make(map[int32]time.Time, len(from))
	// (Never from the start: a record that cannot be read where it should
	// be fails the run, after a while, rather than time it by an early one.)
	rd, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: from}),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtEnd()))
	if err != nil {
		return time.Time{}, 0, err
	}
	defer rd.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for len(last) < len(from) {
		fs := rd.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return time.Time{}, 0, fmt.Errorf("read the last records of %s: %w", topic, err)
		}
		for _, e := range fs.Errors() {
			return time.Time{}, 0, fmt.Errorf("read the last records of %s: %w", topic, e.Err)
		}
		fs.EachRecord(func(r *kgo.Record) { last[r.Partition] = r.Timestamp })
	}
	var at time.Time
	for _, t := range last {
		if t.After(at) {
			at = t
		}
	}
	return at, total, nil
}

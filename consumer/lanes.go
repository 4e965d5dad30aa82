package consumer

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/hipq/hipq/correlator"
	"github.com/hipq/hipq/store"
)

// A group applies its records in lanes: GroupConfig.Concurrency
// goroutines, each applying one batch at a time in its own transaction.
// Every partition belongs to one lane while it is assigned here, so its
// records are applied in order, one batch after the other, each batch's
// offset compare-and-set starting where the one before ended; batches of
// partitions in different lanes are applied at once. With more than one
// lane the poll loop reads on while the lanes apply: each lane takes
// everything read for it since its last transaction (up to two
// transactions' worth buffered), so a busy lane batches as a single loop
// would, and an idle one starts at once. With one lane the group polls,
// applies and polls again, as it always did.
//
// A partition's records are tagged at poll time with the partition's
// epoch, which every seek, assignment and revocation bumps: a lane drops
// what was read before (it will be read again from the new position), so
// a record can never be applied past a gap. A batch PostgreSQL cannot
// take for a passing reason is tried again in place, with backoff, while
// its partitions stay assigned: the records behind it in its lane wait,
// those of other lanes go on.

// laneBatch is one lane's share of one poll or more, each record with
// its partition's epoch when it was read.
type laneBatch struct {
	recs   []*kgo.Record
	epochs []uint64
}

// part is what the group knows of one partition (under group.mu).
type part struct {
	epoch   uint64 // never reused: group.epochs counts them
	lane    int
	stalled bool // a conflict asked for a reload: its records are dropped until then
	busy    int  // batches of it being applied
}

func tpOf(r *kgo.Record) store.TopicPartition {
	return store.TopicPartition{Topic: r.Topic, Partition: r.Partition}
}

// partLocked returns tp's state, creating it in the lane with the fewest
// partitions (so the partitions held here spread over the lanes).
func (g *group) partLocked(tp store.TopicPartition) *part {
	if p, ok := g.parts[tp]; ok {
		return p
	}
	count := make([]int, g.cfg.Concurrency)
	for _, p := range g.parts {
		count[p.lane]++
	}
	g.epochs++
	p := &part{lane: slices.Index(count, slices.Min(count)), epoch: g.epochs}
	g.parts[tp] = p
	return p
}

// resetLocked starts a new epoch for tp: its records read so far are
// dropped, wherever they wait.
func (g *group) resetLocked(tp store.TopicPartition) {
	p := g.partLocked(tp)
	g.epochs++
	p.epoch = g.epochs
	p.stalled = false
	delete(g.reloads, tp)
	if g.paused[tp] && g.wake != nil {
		g.wake() // flush resumes it, should its lane no longer be stuck
	}
}

// split tags recs with their partitions' epochs and adds them to their
// lanes' buffers; records of partitions not assigned here, or
// stalled until a reload, are dropped (read again once sought).
func (g *group) split(recs []*kgo.Record) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, r := range recs {
		tp := tpOf(r)
		if _, ok := g.pos[tp]; !ok {
			continue
		}
		p := g.partLocked(tp)
		if p.stalled {
			continue
		}
		b := g.pending[p.lane]
		if b == nil {
			b = &laneBatch{}
			g.pending[p.lane] = b
		}
		b.recs = append(b.recs, r)
		b.epochs = append(b.epochs, p.epoch)
	}
	g.cond.Broadcast()
}

// stuckAfter is how long the poll loop waits for a lane whose buffer is
// full before it pauses the lane's partitions and reads on for the others.
const stuckAfter = 2 * time.Second

// full says lane i's buffer holds two transactions' worth of records:
// the poll loop reads no more for it until the lane takes them.
func (g *group) fullLocked(i int) bool {
	return g.pending[i] != nil && len(g.pending[i].recs) >= 2*g.cfg.MaxPollRecords
}

// flush waits while a lane's buffer is full. A lane that takes nothing
// for stuckAfter (a batch PostgreSQL keeps refusing, tried again in place)
// has its partitions paused, so the poll loop reads on for the others:
// one stuck lane never holds back the rest. They are resumed once it
// takes its records, and partitions revoked while paused are resumed too.
// (franz-go drops what it buffered of a paused partition and reads it
// again from the same offset once resumed.) Only the poll loop calls it.
func (g *group) flush() {
	g.mu.Lock()
	deadline := time.Now().Add(stuckAfter)
	timer := time.AfterFunc(stuckAfter, func() {
		g.mu.Lock()
		g.cond.Broadcast()
		g.mu.Unlock()
	})
	for !g.closed {
		waiting := false
		for i := range g.pending {
			if g.fullLocked(i) && !g.stuck[i] {
				waiting = true
				if !time.Now().Before(deadline) {
					g.stuck[i] = true
					waiting = false
					g.log.Warn("a lane took no records for a while; reading on for the other lanes' partitions",
						zap.String("group", g.cfg.Group), zap.Int("lane", i), zap.Duration("for", stuckAfter))
				}
			}
		}
		if !waiting {
			break
		}
		g.cond.Wait()
	}
	timer.Stop()
	for i := range g.pending {
		if !g.fullLocked(i) {
			g.stuck[i] = false
		}
	}
	pause, resume := map[string][]int32{}, map[string][]int32{}
	for tp, p := range g.parts {
		if g.stuck[p.lane] && !g.paused[tp] {
			g.paused[tp] = true
			pause[tp.Topic] = append(pause[tp.Topic], tp.Partition)
		}
	}
	for tp := range g.paused {
		if p, ok := g.parts[tp]; !ok || !g.stuck[p.lane] {
			delete(g.paused, tp)
			resume[tp.Topic] = append(resume[tp.Topic], tp.Partition)
		}
	}
	g.mu.Unlock()
	if len(resume) > 0 {
		g.cl.ResumeFetchPartitions(resume)
	}
	if len(pause) > 0 {
		g.cl.PauseFetchPartitions(pause)
	}
}

// runLane applies lane i's records until the group closes: each time,
// everything read for it since it last looked (so a lane batches what
// arrived during its last transaction, as a single poll loop would), a
// transaction per MaxPollRecords. Once ctx ends it drops what it has not
// begun (not committed, so read again at the next start) and ends after
// the transaction it is in.
func (g *group) runLane(ctx context.Context, i int) {
	for {
		g.mu.Lock()
		for g.pending[i] == nil && !g.closed {
			g.cond.Wait()
		}
		b := g.pending[i]
		g.pending[i] = nil
		g.taken++
		g.cond.Broadcast()
		if g.stuck[i] && g.wake != nil {
			g.wake() // the poll loop resumes the lane's partitions now
		}
		g.mu.Unlock()
		if b == nil {
			return
		}
		for len(b.recs) > 0 && ctx.Err() == nil {
			n := min(len(b.recs), g.cfg.MaxPollRecords)
			g.applyBatch(ctx, &laneBatch{recs: b.recs[:n], epochs: b.epochs[:n]})
			b.recs, b.epochs = b.recs[n:], b.epochs[n:]
		}
		g.mu.Lock()
		g.done++
		g.cond.Broadcast()
		g.mu.Unlock()
	}
}

// waitLane waits until the one lane applied everything read: with
// concurrency 1 the group polls, applies and polls again, reading nothing
// ahead, so under load an instance finishes the work it has before it
// takes more (intake's default: hipq bench ran faster so).
func (g *group) waitLane() {
	g.mu.Lock()
	defer g.mu.Unlock()
	for !g.closed && (g.pending[0] != nil || g.done < g.taken) {
		g.cond.Wait()
	}
}

// applyBatch applies a lane's batch, again with backoff while PostgreSQL's
// failure may pass and its partitions are still assigned here.
func (g *group) applyBatch(ctx context.Context, b *laneBatch) {
	for try := 0; ; try++ {
		c := g.claimBatch(b)
		if len(c.recs) == 0 {
			return
		}
		err := g.process(context.WithoutCancel(ctx), c, c.recs)
		g.releaseBatch(c.recs)
		var conflict conflictError
		switch {
		case err == nil:
			return
		case errors.As(err, &conflict):
			// The conflicting partitions are stalled until sought; the
			// batch's other partitions (a split batch stops at its first
			// conflict) are applied on the next turn.
			g.log.Warn("records were already applied by another consumer; seeking to the stored offsets",
				zap.String("group", g.cfg.Group), zap.Int("records", len(c.recs)))
			g.askReload(conflict.tps)
			try = -1
			continue
		}
		wait := backoff(try)
		g.log.Error("cannot apply records; trying them again", zap.String("group", g.cfg.Group),
			zap.Int("records", len(c.recs)), zap.Int("try", try+1), zap.Duration("in", wait),
			zap.String("error", correlator.Clip(err.Error(), 2048)))
		sleep(ctx, wait)
		if ctx.Err() != nil {
			return
		}
	}
}

// claimed is a batch a lane applies: its records, and each partition's
// offset and epoch when it was claimed.
type claimed struct {
	recs  []*kgo.Record
	from  map[store.TopicPartition]int64
	epoch map[store.TopicPartition]uint64
}

// claimBatch returns b's records still to apply (their partitions in the
// epoch they were read in, and at or past the stored offset), marking
// their partitions busy.
func (g *group) claimBatch(b *laneBatch) *claimed {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]*kgo.Record, 0, len(b.recs))
	epochs := make([]uint64, 0, len(b.recs))
	for i, r := range b.recs {
		tp := tpOf(r)
		p, ok := g.parts[tp]
		pos, assigned := g.pos[tp]
		if ok && assigned && !p.stalled && p.epoch == b.epochs[i] && r.Offset >= pos {
			out = append(out, r)
			epochs = append(epochs, b.epochs[i])
		}
	}
	b.recs, b.epochs = out, epochs
	c := &claimed{recs: out, from: map[store.TopicPartition]int64{}, epoch: map[store.TopicPartition]uint64{}}
	for tp := range partitionsOf(out) {
		p := g.parts[tp]
		p.busy++
		c.from[tp], c.epoch[tp] = g.pos[tp], p.epoch
	}
	return c
}

func (g *group) releaseBatch(recs []*kgo.Record) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for tp := range partitionsOf(recs) {
		if p, ok := g.parts[tp]; ok {
			p.busy--
			if _, assigned := g.pos[tp]; !assigned && p.busy == 0 {
				delete(g.parts, tp) // revoked while busy: its lane is free again
			}
		}
	}
	g.cond.Broadcast()
}

func partitionsOf(recs []*kgo.Record) map[store.TopicPartition]struct{} {
	out := map[store.TopicPartition]struct{}{}
	for _, r := range recs {
		out[tpOf(r)] = struct{}{}
	}
	return out
}

// askReload stalls tps (their records are dropped from now on) until the
// poll loop has sought them to PostgreSQL's offsets; it wakes a poll that
// waits for records.
func (g *group) askReload(tps []store.TopicPartition) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, tp := range tps {
		if _, ok := g.pos[tp]; !ok {
			continue // revoked meanwhile: its next owner seeks it
		}
		p := g.partLocked(tp)
		g.epochs++
		p.epoch = g.epochs
		p.stalled = true
		g.reloads[tp] = struct{}{}
	}
	if g.wake != nil {
		g.wake()
	}
	g.cond.Broadcast()
}

// reloadAsked seeks the partitions lanes asked for to PostgreSQL's
// offsets. The poll loop calls it after a poll, before it allows a
// rebalance (franz-go's advice for seeking in a group); one that fails is
// asked again at the next poll.
func (g *group) reloadAsked(ctx context.Context) {
	g.mu.Lock()
	tps := make([]store.TopicPartition, 0, len(g.reloads))
	for tp := range g.reloads {
		tps = append(tps, tp)
	}
	due := !time.Now().Before(g.reloadAt)
	g.mu.Unlock()
	if len(tps) == 0 || !due {
		return
	}
	load, cancel := context.WithTimeout(ctx, g.cfg.rebalanceTimeout()/2) // a rebalance waits meanwhile
	stored, err := g.st.OffsetsLoad(load, g.cfg.Group, tps)
	cancel()
	if err != nil {
		g.mu.Lock()
		g.reloadFailures++
		wait := backoff(g.reloadFailures - 1)
		g.reloadAt = time.Now().Add(wait)
		g.mu.Unlock()
		g.log.Warn("cannot reload stored offsets; trying again", zap.String("group", g.cfg.Group),
			zap.Duration("in", wait), zap.Error(err))
		return
	}
	seek := map[string]map[int32]kgo.EpochOffset{}
	g.mu.Lock()
	g.reloadFailures = 0
	for _, tp := range tps {
		if _, asked := g.reloads[tp]; !asked {
			continue // revoked or reassigned meanwhile
		}
		next, ok := stored[tp]
		g.pos[tp] = -1
		g.resetLocked(tp)
		if !ok && g.cfg.Start == StartLatest {
			continue // the stored offset is gone (deleted by hand): read on, as a first assignment at latest would
		}
		if ok {
			g.pos[tp] = next
		}
		// Gone with start earliest: the partition is read again from its
		// start, as at a first assignment.
		if seek[tp.Topic] == nil {
			seek[tp.Topic] = map[int32]kgo.EpochOffset{}
		}
		seek[tp.Topic][tp.Partition] = kgo.EpochOffset{Epoch: -1, Offset: max(next, 0)}
	}
	g.mu.Unlock()
	g.cl.SetOffsets(seek)
}

// waitIdleLocked waits, until deadline at most, for the lanes to finish
// the batches of tps they are applying. g.mu is held.
func (g *group) waitIdleLocked(tps []store.TopicPartition, deadline time.Time) {
	t := time.AfterFunc(time.Until(deadline), func() {
		g.mu.Lock()
		g.cond.Broadcast()
		g.mu.Unlock()
	})
	defer t.Stop()
	for time.Now().Before(deadline) {
		busy := false
		for _, tp := range tps {
			if p, ok := g.parts[tp]; ok && p.busy > 0 {
				busy = true
			}
		}
		if !busy {
			return
		}
		g.cond.Wait()
	}
}

// conflictError: another consumer applied (some of) a batch's records
// first; tps are its partitions.
type conflictError struct{ tps []store.TopicPartition }

func (e conflictError) Error() string { return store.ErrOffsetConflict.Error() }
func (e conflictError) Unwrap() error { return store.ErrOffsetConflict }

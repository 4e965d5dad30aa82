package main

import (
	"context"
	"os"
	"runtime/metrics"
	"runtime/pprof"
	"time"
)

// watchHeapPeak writes a heap profile to path each time the heap's
// objects reach a new high (by a MiB or more), until ctx ends: the file
// left is the heap as the last collection before its peak saw it (hipq
// bench --memprofile). Each profile is written aside and renamed, so the
// file is always whole.
func watchHeapPeak(ctx context.Context, path string, every time.Duration) error {
	sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	var peak uint64
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		metrics.Read(sample)
		if sample[0].Value.Kind() != metrics.KindUint64 {
			return nil
		}
		if v := sample[0].Value.Uint64(); v >= peak+1<<20 {
			peak = v
			if err := writeHeapProfile(path); err != nil {
				return err
			}
		}
	}
}

func writeHeapProfile(path string) error {
	f, err := os.Create(path + ".tmp")
	if err != nil {
		return err
	}
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(path+".tmp", path)
}

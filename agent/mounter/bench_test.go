package mounter

import (
	"context"
	"os"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkPublishUnpublish: a publish and an unpublish through the
// mounter (socket round trips, checks, descriptors, open_tree and
// move_mount, mountinfo) against the same bind mount by path (mkdir,
// mount, umount, rmdir) beside it, in pairs of alternating order; it
// reports the median ratio and the median time of the mounter's pair.
func BenchmarkPublishUnpublish(b *testing.B) {
	f := newFixture(b)
	r := f.volume(b, testUID, "ram")
	ctx := context.Background()
	viaMounter := func() time.Duration {
		start := time.Now()
		must(b, f.client.Publish(ctx, r))
		must(b, f.client.Unpublish(ctx, unpublishOf(r)))
		return time.Since(start)
	}
	byPath := func() time.Duration {
		start := time.Now()
		must(b, os.Mkdir(r.Target, 0o750))
		must(b, unix.Mount(r.Source, r.Target, "", unix.MS_BIND, ""))
		must(b, unix.Mount("", r.Target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""))
		must(b, unix.Unmount(r.Target, unix.MNT_DETACH))
		must(b, os.Remove(r.Target))
		return time.Since(start)
	}
	var ratios, times []float64
	for b.Loop() {
		for i := range 20 {
			var m, p time.Duration
			if i%2 == 0 {
				m, p = viaMounter(), byPath()
			} else {
				p, m = byPath(), viaMounter()
			}
			ratios, times = append(ratios, float64(m)/float64(p)), append(times, float64(m.Microseconds()))
		}
	}
	b.ReportMetric(median(ratios), "mounter/path")
	b.ReportMetric(median(times), "µs/mounter-pair")
}

func median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}

package guest

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// BenchmarkKernelBoot boots the cloud and the generic guest side by side,
// VMSNAP_BENCH_BOOTS pairs (default 5), and reports each flavour's time from
// QEMU's start to "VMSNAP ready" (wall, and the guest's own uptime then):
// min, median and max, and the generic/cloud ratio of the medians. Side by
// side, so that the machine's load weighs on both alike.
//
//	go test -run '^$' -bench KernelBoot -benchtime 1x ./internal/testing/guest
func BenchmarkKernelBoot(b *testing.B) {
	pairs := 5
	if n, err := strconv.Atoi(os.Getenv("VMSNAP_BENCH_BOOTS")); err == nil && n > 0 {
		pairs = n
	}
	flavours := []Kernel{KernelCloud, KernelGeneric}
	for _, k := range flavours {
		KernelAssets(b, k)
	}
	wall := map[Kernel][]time.Duration{}
	uptime := map[Kernel][]time.Duration{}
	var mu sync.Mutex
	for range b.N {
		for range pairs {
			var wg sync.WaitGroup
			for _, k := range flavours {
				wg.Go(func() {
					w, u := bootOnce(b, k)
					mu.Lock()
					wall[k], uptime[k] = append(wall[k], w), append(uptime[k], u)
					mu.Unlock()
				})
			}
			wg.Wait()
		}
	}
	for _, k := range flavours {
		b.Logf("%-8s wall to ready %s; guest uptime at ready %s", k, spread(wall[k]), spread(uptime[k]))
	}
	ratio := float64(median(wall[KernelGeneric])) / float64(median(wall[KernelCloud]))
	b.ReportMetric(ratio, "generic/cloud-wall")
	b.ReportMetric(float64(median(uptime[KernelGeneric]))/float64(median(uptime[KernelCloud])), "generic/cloud-uptime")
}

// bootOnce boots k's guest and returns the wall time to its ready line and
// the guest's uptime in that line.
func bootOnce(b *testing.B, k Kernel) (wall, uptime time.Duration) {
	vm := Start(b, Options{Kernel: k, Dir: FreeShortDir(b)})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ready, err := vm.WaitReady(ctx)
	if err != nil {
		b.Errorf("%s guest: %v", k, err)
		return 0, 0
	}
	wall = time.Since(vm.Started())
	for _, f := range strings.Fields(ready.Line) {
		if v, ok := strings.CutPrefix(f, "uptime="); ok {
			if s, err := strconv.ParseFloat(v, 64); err == nil {
				uptime = time.Duration(s * float64(time.Second))
			}
		}
	}
	vm.Kill()
	return wall, uptime
}

func spread(ds []time.Duration) string {
	if len(ds) == 0 {
		return "(none)"
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	r := func(d time.Duration) string { return d.Round(100 * time.Millisecond).String() }
	return fmt.Sprintf("min %s, median %s, max %s (%d boots)", r(s[0]), r(median(s)), r(s[len(s)-1]), len(s))
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

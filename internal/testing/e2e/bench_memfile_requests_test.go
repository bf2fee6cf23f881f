//go:build linux

package e2e

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// mfRequests is how many requests each operation of the memory-file
// section made of the registry (its access log: every request, the auth
// challenges included), the last run's: the packs + index format moves a
// few large blobs where the region-layer format moved one per 2 MiB region.
type mfRequests struct {
	streamCkpt, mfCkpt, streamRestore, coldPrepare int
}

// accessLine is a request in docker-registry's access log.
var accessLine = regexp.MustCompile(`(?m)^\S+ - \S+ \[[^\]]*\] "[A-Z]+ /v2/`)

// registryRequests is how many requests the bench registry has logged.
func (bb *bench) registryRequests() int {
	return len(accessLine.FindAllStringIndex(bb.reg.LogTail(1<<30), -1))
}

// counted runs op and returns the requests it made.
func (bb *bench) counted(op func()) int {
	before := bb.registryRequests()
	op()
	return bb.registryRequests() - before
}

// requestRows are the rows of the request counts and of the checkpoint
// time against the stream path's.
func requestRows(rowf func(string, func(s *mfSize) string, string, func(s *mfSize) bool)) {
	rowf("registry requests: checkpoint stream; memory-file", func(s *mfSize) string {
		return fmt.Sprintf("%d; %d", s.requests.streamCkpt, s.requests.mfCkpt)
	}, "", nil)
	rowf("registry requests: stream restore; cold prepare", func(s *mfSize) string {
		return fmt.Sprintf("%d; %d", s.requests.streamRestore, s.requests.coldPrepare)
	}, "", nil)
	rowf("  memory-file / stream checkpoint total", func(s *mfSize) string {
		return fmt.Sprintf("%.2fx", medianF(s.mfTotal)/medianF(s.streamTotal))
	}, "<= 1.10x", func(s *mfSize) bool { return medianF(s.mfTotal) <= 1.1*medianF(s.streamTotal) })
}

// benchMFSizes is VMSNAP_BENCH_MF_SIZES (guest sizes in MiB, comma
// separated), or def.
func benchMFSizes(b *testing.B, def ...int) []int {
	s := os.Getenv("VMSNAP_BENCH_MF_SIZES")
	if s == "" {
		return def
	}
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 512 {
			b.Fatalf("VMSNAP_BENCH_MF_SIZES=%q: want sizes in MiB, at least 512", s)
		}
		out = append(out, n)
	}
	return out
}

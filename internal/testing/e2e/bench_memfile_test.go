//go:build linux

package e2e

// benchMemoryFile is make bench's memory-file section (BenchmarkE2E/memfile,
// issue #15): 1 GiB and 4 GiB guests with 256 MiB of random data whose RAM
// is a shared file on /dev/shm, checkpointed to the same TLS + htpasswd
// registry with --format stream and --format memory-file side by side in
// one run, and restored both ways. Per guest size:
//
//   - snapshot mode, runs interleaved: a stream checkpoint and a
//     memory-file base (each into its own tag), their guest downtime
//     (vmsnap's downtimeMs) and vmsnap's peak RSS for the memory-file one;
//   - restores of each run's images into fresh QEMUs waiting with
//     -incoming defer: the stream image (command start to running); the
//     memory-file image cold (vmsnap prepare into an empty cache, then
//     restore) and with the file already on the node (prepare finds it,
//     fetchedBytes 0; the restore timed alone);
//   - a chain, each checkpoint under a tag of its own (its parent is the
//     one the node recorded): a base, the idle VM's second checkpoint after
//     it ran VMSNAP_BENCH_IDLE, one after 5% of the random data was
//     rewritten from the host in 205 scattered 64 KiB pieces, one after a 5%
//     contiguous rewrite, and a last one in pause mode with the disk; the
//     last (base + 4 deltas) is prepared cold and restored, and the guest
//     must come back exact: its memory checksum, recomputed by the guest,
//     equal to the source's at the same counter, with the source's boot id,
//     counter and disk marker;
//   - 1 GiB only: 4 clones of that image on this node, mapping the one
//     prepared file: the node's memory for 4 against for 1.
//   - what trusting a parent only as far as the checkpoint verified it
//     costs: pairs of deltas on a recorded parent and on one named with
//     --parent (each page it vouches for checked with SHA-256), in
//     snapshot and pause mode (bench_memfile_trust_test.go).
//
// Every restore checks the guest carries on (boot id, counter, memory
// checksums, disk marker). The guests recompute their memory checksum every
// benchMemEvery status lines (about a second each): often enough for the
// exactness checks, rarely enough not to keep a core busy.

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

const (
	benchMFBigMemMB  = 4096
	benchMemEvery    = 15 // status lines between the guest's memory checksums
	benchScatterRun  = 16 // pages in one scattered piece: 64 KiB
	benchClones      = 4
	benchCloneSettle = 5 * time.Second
)

// The targets (#15).
const (
	targetWarmRestoreMs   = 50
	targetDowntimeShare   = 0.25
	targetIdleShare       = 0.02
	targetScatteredShare  = 0.10
	targetContiguousShare = 0.08
	targetCloneMemory     = 1.5
)

type mfReport struct {
	sizes []*mfSize
	total time.Duration
	load0 string
	load1 string
}

type mfSize struct {
	memMB int
	boot  time.Duration
	// snapshot-mode checkpoints: downtime and total, ms
	streamDown, streamTotal, mfDown, mfTotal []float64
	mfStored                                 int64
	streamStored                             int64
	// restores
	streamRestore                []time.Duration // wall, command start to running
	streamRestoreFile            time.Duration   // the same into a shared RAM file (once)
	streamRestoreFileAlloc       int64           // that file's allocated bytes after it
	mfSave                       []float64       // the scan's part of the downtime, ms
	mfAlloc                      []int64         // the RAM file's allocated bytes before the checkpoint
	streamRestoreMs              []float64       // its durationsMs.total
	coldPrepare, coldRestore     []time.Duration // wall
	coldFetched                  int64
	warmRestore                  []time.Duration // wall
	warmRestoreMs, warmPrepareMs []float64       // durationsMs.total
	warmPrepare                  []time.Duration // wall of prepare finding the file
	warmPrepareP, warmStreamP    []float64       // the restores' prepare and stream phases, ms
	rssCkpt, rssPrepare          int64           // KiB, peak over the runs
	chain                        []mfChainRow
	chainRestore                 time.Duration // cold prepare + restore of base + deltas
	chainFetched                 int64
	exact                        string // what the exactness check compared
	clones                       *cloneMemory
	trust                        *trustCost
	rewriteSpan                  string
	requests                     mfRequests
}

type mfChainRow struct {
	name             string
	uploaded, stored int64
	changedPages     int
	downtimeMs       float64
	target           float64 // share of stored; 0: none
}

type cloneMemory struct {
	pss1, pss4         int64 // sum of the QEMUs' Pss
	private1, private4 int64 // sum of their Pss outside the RAM file's mapping
	file1, file4       int64 // the RAM file's allocated bytes
}

func (c *cloneMemory) node1() int64 { return c.private1 + c.file1 }
func (c *cloneMemory) node4() int64 { return c.private4 + c.file4 }

// mfGuest is a memory-file bench guest: its RAM file, its disk, and a
// directory beside the disk's base for copies of its overlay (restore
// targets need the disk's marker).
type mfGuest struct {
	vm      *guest.VM
	memMB   int
	ram     string
	overlay string
	copies  int
}

func benchMemoryFile(b *testing.B) {
	if fi, err := os.Stat("/dev/shm"); err != nil || !fi.IsDir() {
		guest.SkipOrFail(b, "tmpfs", "no /dev/shm for the guests' RAM files")
	}
	var bb *bench
	var rep mfReport
	for b.Loop() {
		bb = &bench{b: b, runs: benchRuns(b, 5), idle: 10 * time.Second}
		if s := os.Getenv("VMSNAP_BENCH_IDLE"); s != "" {
			d, err := time.ParseDuration(s)
			if err != nil {
				b.Fatalf("VMSNAP_BENCH_IDLE=%q: %v", s, err)
			}
			bb.idle = d
		}
		start := time.Now()
		rep = mfReport{load0: loadAvg()}
		bb.bin = bb.vmsnapBinary()
		bb.mfQEMU, bb.mfQEMUName = benchMFQEMU(b)
		bb.reg = registry.Start(b)
		for _, memMB := range benchMFSizes(b, benchMemMB, benchMFBigMemMB) {
			rep.sizes = append(rep.sizes, bb.memoryFileSize(memMB))
		}
		rep.total = time.Since(start)
		rep.load1 = loadAvg()
	}
	rep.print(os.Stdout, bb)
	rep.metrics(b)
}

// benchMFQEMU is the QEMU the memory-file section runs, both paths: QEMU
// 10 by default, since under TCG a snapshot pre-copies only from QEMU 9.0
// on (QEMU 7.2's dirty log loses writes: it scans instead);
// VMSNAP_BENCH_MF_QEMU=system runs the system's QEMU.
func benchMFQEMU(b *testing.B) (root, name string) {
	switch v := os.Getenv("VMSNAP_BENCH_MF_QEMU"); v {
	case "", "10":
		return guest.QEMU10(b), "QEMU " + guest.QEMU10Version + " (unpacked; VMSNAP_BENCH_MF_QEMU=system for the system's)"
	case "system":
		out, err := exec.Command("qemu-system-x86_64", "--version").Output()
		if err != nil {
			b.Fatalf("qemu-system-x86_64 --version: %v", err)
		}
		return "", strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
	default:
		b.Fatalf("VMSNAP_BENCH_MF_QEMU=%q: want 10 or system", v)
		return "", ""
	}
}

// benchRuns is VMSNAP_BENCH_RUNS, or def.
func benchRuns(b *testing.B, def int) int {
	s := os.Getenv("VMSNAP_BENCH_RUNS")
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		b.Fatalf("VMSNAP_BENCH_RUNS=%q: want a positive number", s)
	}
	return n
}

// memoryFileSize runs the section on a guest of memMB.
func (bb *bench) memoryFileSize(memMB int) *mfSize {
	b := bb.b
	r := &mfSize{memMB: memMB}
	g := bb.bootMF(memMB)
	defer g.vm.Kill()
	r.boot = time.Since(g.vm.Started())
	src := g.vm
	streamRepo, mfRepo := bb.repo(fmt.Sprintf("mf-stream-%d", memMB)), bb.repo(fmt.Sprintf("mf-file-%d", memMB))

	// Checkpoints, interleaved, each a full one into its own tag. The
	// first run takes the memory-file one first: QEMU's stream reads every
	// page of the RAM file, and on tmpfs reading a hole through QEMU's
	// shared mapping allocates it, so after the first stream checkpoint the
	// file is all allocated and a scan reads all of it (as it would for a
	// guest that has touched all its memory).
	type images struct {
		stream, file string
		at           guest.Status
	}
	var ims []images
	for i := range bb.runs {
		var sc, mc api.CheckpointResult
		// The restores carry on from after the first of the two.
		at := bb.settled(src)
		streamCkpt := func() {
			bb.settled(src)
			r.requests.streamCkpt = bb.counted(func() {
				bb.runCLI(src, &sc, "checkpoint", "--qmp", src.QMPPath(), "--image", fmt.Sprintf("%s:r%d", streamRepo, i), "--mode", "snapshot", "--format", "stream")
			})
			if sc.VMState.Format != vmspec.FormatStream || !sc.VMRunning {
				b.Fatalf("stream checkpoint: format %q, running %v", sc.VMState.Format, sc.VMRunning)
			}
			r.streamDown, r.streamTotal = append(r.streamDown, sc.DowntimeMs), append(r.streamTotal, sc.TotalMs)
			r.streamStored = sc.VMState.StoredBytes
		}
		if i > 0 {
			streamCkpt()
			bb.settled(src)
		}
		alloc := allocated(b, g.ram)
		// No parent records: each a base.
		var rss int64
		r.requests.mfCkpt = bb.counted(func() {
			rss, _, _ = bb.peakRun(&mc, "checkpoint", "--qmp", src.QMPPath(), "--image", fmt.Sprintf("%s:r%d", mfRepo, i), "--mode", "snapshot", "--format", "memory-file", "--parent-records", "")
		})
		if mc.VMState.Format != vmspec.FormatMemoryFile || !mc.VMRunning || mc.VMState.RAM == nil || len(mc.VMState.RAM.Chain) != 1 {
			b.Fatalf("memory-file checkpoint: format %q, running %v, ram %+v: want a base", mc.VMState.Format, mc.VMRunning, mc.VMState.RAM)
		}
		checkSnapshotCapture(b, mc.VMState.RAM, bb.mfQEMU != "")
		r.rssCkpt = max(r.rssCkpt, rss)
		r.mfDown, r.mfTotal = append(r.mfDown, mc.DowntimeMs), append(r.mfTotal, mc.TotalMs)
		r.mfSave, r.mfAlloc = append(r.mfSave, mc.VMState.DurationsMs["save"]), append(r.mfAlloc, alloc)
		r.mfStored = mc.VMState.StoredBytes
		if i == 0 {
			streamCkpt()
		}
		b.Logf("bench: %d MiB snapshot mode: stream downtime %.0f ms of %.0f ms (%s stored); memory-file downtime %.0f ms of %.0f ms (RAM file %s allocated; %s stored, durations %v), peak RSS %.1f MiB",
			memMB, sc.DowntimeMs, sc.TotalMs, humanBytes(sc.VMState.StoredBytes), mc.DowntimeMs, mc.TotalMs, humanBytes(alloc), humanBytes(mc.VMState.StoredBytes), mc.VMState.DurationsMs, float64(rss)/1024)
		ims = append(ims, images{sc.VMState.Image, mc.VMState.Image, at})
	}

	// Restores, interleaved.
	for _, im := range ims {
		// The stream path's restore, into anonymous RAM under the same
		// backend ID (its fastest: pages it does not write stay unallocated).
		t := bb.mfTarget(g, []string{"-object", fmt.Sprintf("memory-backend-ram,id=ram0,size=%dM", memMB), "-machine", "memory-backend=ram0"})
		var rs api.RestoreResult
		var tm timed
		r.requests.streamRestore = bb.counted(func() { tm = bb.runCLI(t, &rs, "restore", "--qmp", t.QMPPath(), "--image", im.stream) })
		bb.mfResumed(t, im.at, rs)
		r.streamRestore, r.streamRestoreMs = append(r.streamRestore, tm.d), append(r.streamRestoreMs, rs.VMState.DurationsMs["total"])
		t.Kill()
		if r.streamRestoreFile == 0 {
			// Once: into a shared RAM file on tmpfs, as the source runs.
			ramDir := shmDir(b)
			t := bb.mfTarget(g, fileRAMArgs(filepath.Join(ramDir, "target.ram"), memMB))
			var rs api.RestoreResult
			tm := bb.runCLI(t, &rs, "restore", "--qmp", t.QMPPath(), "--image", im.stream)
			bb.mfResumed(t, im.at, rs)
			r.streamRestoreFile, r.streamRestoreFileAlloc = tm.d, allocated(b, filepath.Join(ramDir, "target.ram"))
			t.Kill()
			os.RemoveAll(ramDir)
		}

		cache := filepath.Join(shmDir(b), "cache")
		var p api.PrepareResult
		var rss int64
		var pd time.Duration
		r.requests.coldPrepare = bb.counted(func() { rss, pd, _ = bb.peakRun(&p, "prepare", im.file, "--cache-dir", cache) })
		if p.FetchedBytes <= 0 {
			b.Fatalf("cold prepare fetched %d bytes", p.FetchedBytes)
		}
		r.rssPrepare, r.coldFetched = max(r.rssPrepare, rss), p.FetchedBytes
		t = bb.mfTarget(g, p.QEMUArgs)
		rs = api.RestoreResult{}
		tm = bb.runCLI(t, &rs, "restore", "--qmp", t.QMPPath(), "--image", im.file, "--cache-dir", cache)
		bb.mfResumed(t, im.at, rs)
		r.coldPrepare, r.coldRestore = append(r.coldPrepare, pd), append(r.coldRestore, tm.d)
		t.Kill()

		// The file on the node: prepare finds it, the restore alone is
		// timed, three times (it is short: the machine's noise weighs).
		var ptm timed
		for range 3 {
			var p2 api.PrepareResult
			ptm = bb.runCLI(src, &p2, "prepare", im.file, "--cache-dir", cache)
			if p2.FetchedBytes != 0 || p2.MemoryFile != p.MemoryFile {
				b.Fatalf("second prepare fetched %d bytes into %s (first %s)", p2.FetchedBytes, p2.MemoryFile, p.MemoryFile)
			}
			t = bb.mfTarget(g, p2.QEMUArgs)
			rs = api.RestoreResult{}
			tm = bb.runCLI(t, &rs, "restore", "--qmp", t.QMPPath(), "--image", im.file, "--cache-dir", cache)
			bb.mfResumed(t, im.at, rs)
			r.warmPrepare, r.warmPrepareMs = append(r.warmPrepare, ptm.d), append(r.warmPrepareMs, p2.DurationsMs["total"])
			r.warmRestore, r.warmRestoreMs = append(r.warmRestore, tm.d), append(r.warmRestoreMs, rs.VMState.DurationsMs["total"])
			r.warmPrepareP = append(r.warmPrepareP, rs.VMState.DurationsMs["prepare"])
			r.warmStreamP = append(r.warmStreamP, rs.VMState.DurationsMs["stream"])
			t.Kill()
		}
		os.RemoveAll(cache)
		b.Logf("bench: %d MiB restore: stream %v (%.0f ms); cold: prepare %v (%s fetched, peak RSS %.1f MiB) + restore %v; file on the node: restore %v (%v), prepare %v",
			memMB, r.streamRestore[len(r.streamRestore)-1].Round(time.Millisecond), r.streamRestoreMs[len(r.streamRestoreMs)-1],
			pd.Round(time.Millisecond), humanBytes(p.FetchedBytes), float64(rss)/1024, r.coldRestore[len(r.coldRestore)-1].Round(time.Millisecond),
			tm.d.Round(time.Millisecond), rs.VMState.DurationsMs, ptm.d.Round(time.Millisecond))
	}

	records := filepath.Join(b.TempDir(), "records")
	bb.memoryFileChain(g, r, records)
	r.trust = bb.parentTrustCost(g, records)
	return r
}

// memoryFileChain checkpoints g, each checkpoint under a tag of its own
// (as a controller's ${TAG} has it: the parent is the checkpoint records
// holds, not a tag): a base, then deltas after the guest idled, after a
// scattered and a contiguous rewrite from the host, and in pause mode with
// the disk; then restores the last (base + 4 deltas) cold and checks the
// guest is exact; for the 1 GiB guest, 4 clones of it share the prepared
// file.
func (bb *bench) memoryFileChain(g *mfGuest, r *mfSize, records string) {
	b := bb.b
	src := g.vm
	repo := bb.repo(fmt.Sprintf("mf-chain-%d", g.memMB))
	var prev api.CheckpointResult
	step := func(name string, target float64, extra ...string) api.CheckpointResult {
		var cp api.CheckpointResult
		image := fmt.Sprintf("%s:chain-%d", repo, len(r.chain))
		bb.runCLI(src, &cp, append([]string{"checkpoint", "--qmp", src.QMPPath(), "--image", image, "--format", "memory-file", "--parent-records", records}, extra...)...)
		ram := cp.VMState.RAM
		if ram == nil || len(ram.Chain) != len(r.chain)+1 || (prev.VMState.Digest != "" && ram.Parent != prev.VMState.Digest) {
			b.Fatalf("%s: not a delta on the previous checkpoint: %+v", name, ram)
		}
		row := mfChainRow{name: name, uploaded: cp.VMState.UploadedBytes, stored: cp.VMState.StoredBytes,
			changedPages: ram.Chain[len(ram.Chain)-1].ChangedPages, downtimeMs: cp.DowntimeMs, target: target}
		r.chain = append(r.chain, row)
		b.Logf("bench: %d MiB chain, %s: uploaded %s of %s (%.2f%%), %d changed pages, downtime %.0f ms of %.0f ms",
			g.memMB, name, humanBytes(row.uploaded), humanBytes(row.stored), 100*float64(row.uploaded)/float64(row.stored), row.changedPages, cp.DowntimeMs, cp.TotalMs)
		prev = cp
		return cp
	}
	step("base", 0, "--mode", "snapshot")
	time.Sleep(bb.idle)
	step(fmt.Sprintf("idle VM's second checkpoint (ran %v)", bb.idle), targetIdleShare, "--mode", "snapshot")

	pages, _ := classifyPages(b, g.ram)
	n := len(pages) * benchRewritePct / 100
	pieces := (n + benchScatterRun - 1) / benchScatterRun
	// Scattered: pieces of 16 pages adjacent in the guest's RAM (64 KiB),
	// at random among the data pages.
	var slots []int
	for s := 0; s+1 <= len(pages)/benchScatterRun; s++ {
		if pages[s*benchScatterRun+benchScatterRun-1]-pages[s*benchScatterRun] == benchScatterRun-1 {
			slots = append(slots, s)
		}
	}
	if len(slots) < pieces {
		b.Fatalf("only %d runs of %d adjacent data pages, want %d", len(slots), benchScatterRun, pieces)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	rng.Shuffle(len(slots), func(i, j int) { slots[i], slots[j] = slots[j], slots[i] })
	var scattered []int64
	for _, s := range slots[:pieces] {
		scattered = append(scattered, pages[s*benchScatterRun:(s+1)*benchScatterRun]...)
	}
	qmpOnce(b, src.QMPPath(), "stop", nil)
	rewritePages(b, g.ram, scattered)
	qmpOnce(b, src.QMPPath(), "cont", nil)
	step(fmt.Sprintf("after %d%% rewritten in %d scattered 64 KiB pieces", benchRewritePct, pieces), targetScatteredShare, "--mode", "snapshot")

	run := contiguousRun(b, pages, n)
	r.rewriteSpan = fmt.Sprintf("%d pages (%s) at guest-physical %#x", len(run), humanBytes(int64(len(run))*4096), run[0]*4096)
	qmpOnce(b, src.QMPPath(), "stop", nil)
	rewritePages(b, g.ram, run)
	qmpOnce(b, src.QMPPath(), "cont", nil)
	step(fmt.Sprintf("after %d%% rewritten contiguously", benchRewritePct), targetContiguousShare, "--mode", "snapshot")

	// The last delta, in pause mode with the disk.
	bb.settled(src)
	diskRepo := bb.repo(fmt.Sprintf("mf-chain-disk-%d", g.memMB))
	last := step("pause mode, with the disk", 0, "--mode", "pause", "--disk", g.overlay, "--disk-image", diskRepo+":chain-4")
	at, _ := src.LastStatus()
	resume := src.ResumeCounter()

	// Cold: an empty cache, the base and every delta fetched.
	cache := filepath.Join(shmDir(b), "cache")
	var p api.PrepareResult
	ptm := bb.runCLI(src, &p, "prepare", last.VMState.Image, "--cache-dir", cache)
	r.chainFetched = p.FetchedBytes
	restoreOne := func() (*guest.VM, time.Duration) {
		disk := g.diskPath()
		var rd api.RestoreResult
		bb.runCLI(src, &rd, "restore", "--disk-image", last.Disk.Image, "--disk", disk)
		t := bb.mfTargetDisk(g, p.QEMUArgs, disk)
		var rs api.RestoreResult
		tm := bb.runCLI(t, &rs, "restore", "--qmp", t.QMPPath(), "--image", last.VMState.Image, "--cache-dir", cache)
		if rs.VMState == nil || !rs.VMState.VMRunning {
			// Pause mode: the source was stopped, so is the restored VM.
			qmpOnce(b, t.QMPPath(), "cont", nil)
		}
		return t, tm.d
	}
	first, rd := restoreOne()
	r.chainRestore = ptm.d + rd
	vms := []*guest.VM{first}
	if g.memMB == benchMemMB {
		// Clones: the node's memory for one, then for four.
		time.Sleep(benchCloneSettle)
		c := &cloneMemory{}
		c.pss1, c.private1, c.file1 = nodeMemory(b, vms, p.MemoryFile)
		for range benchClones - 1 {
			vm, _ := restoreOne()
			vms = append(vms, vm)
		}
		time.Sleep(benchCloneSettle)
		c.pss4, c.private4, c.file4 = nodeMemory(b, vms, p.MemoryFile)
		r.clones = c
		b.Logf("bench: clones: 1: Pss %s (outside the file %s), file %s; %d: Pss %s (outside the file %s), file %s",
			humanBytes(c.pss1), humanBytes(c.private1), humanBytes(c.file1), len(vms), humanBytes(c.pss4), humanBytes(c.private4), humanBytes(c.file4))
	}
	qmpOnce(b, src.QMPPath(), "cont", nil)
	r.exact = bb.sameMemory(src, vms, at, resume)
	for _, vm := range vms {
		vm.Kill()
	}
	os.RemoveAll(cache)
}

// sameMemory waits for the source and the restored guests to recompute
// their memory checksum at the same counter, past resume (the counter the
// restored guests printed first), and checks that every one is the source's
// boot, with its mem0, disk marker and memory checksum.
func (bb *bench) sameMemory(src *guest.VM, vms []*guest.VM, at guest.Status, resume int) string {
	b := bb.b
	c := (resume/benchMemEvery + 1) * benchMemEvery
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	line := func(vm *guest.VM) guest.Status {
		if _, err := vm.WaitStatus(ctx, func(s guest.Status) bool { return s.Counter >= c }); err != nil {
			b.Fatalf("no status line %d: %v\n%s", c, err, vm.SerialTail(5))
		}
		for _, s := range vm.Statuses() {
			if s.Counter == c {
				return s
			}
		}
		b.Fatalf("no status line with counter %d:\n%s", c, vm.SerialTail(10))
		return guest.Status{}
	}
	want := line(src)
	if want.Boot != at.Boot || want.Mem0 != at.Mem0 {
		b.Fatalf("the source changed: %s, was %s", want, at)
	}
	for i, vm := range vms {
		got := line(vm)
		if vm.ReadyCount() != 0 || got.Boot != want.Boot || got.Mem != want.Mem || got.Mem0 != want.Mem0 || got.Disk != want.Disk {
			b.Fatalf("restored guest %d is not the source: %s, source %s\n%s", i, got, want, vm.SerialTail(5))
		}
	}
	return fmt.Sprintf("%d guests restored from base + %d deltas and the source, at counter %d: mem=%s (mem0=%s, the host's rewrites) disk=%s",
		len(vms), 4, c, want.Mem, want.Mem0, want.Disk)
}

// allocated is a file's allocated bytes.
func allocated(b *testing.B, path string) int64 {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		b.Fatal(err)
	}
	return st.Blocks * 512
}

// nodeMemory sums the QEMUs' Pss (/proc/PID/smaps), and the part of it
// outside their mappings of the RAM file, and returns the file's allocated
// bytes: the node's memory for these VMs is the part outside the file plus
// the file, counted once (its pages are tmpfs pages whether mapped or not).
func nodeMemory(b *testing.B, vms []*guest.VM, file string) (pss, private, fileBytes int64) {
	real, err := filepath.EvalSymlinks(file)
	if err != nil {
		b.Fatal(err)
	}
	for _, vm := range vms {
		f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", vm.Process().Pid))
		if err != nil {
			b.Fatal(err)
		}
		inFile := false
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) == 0 {
				continue
			}
			if !strings.HasSuffix(fields[0], ":") { // a mapping's header
				inFile = len(fields) >= 6 && fields[5] == real
				continue
			}
			if fields[0] == "Pss:" && len(fields) >= 2 {
				kb, _ := strconv.ParseInt(fields[1], 10, 64)
				pss += kb << 10
				if !inFile {
					private += kb << 10
				}
			}
		}
		f.Close()
	}
	return pss, private, allocated(b, real)
}

// bootMF boots a guest of memMB (benchDataMB of random data) whose RAM is a
// shared file on /dev/shm, with a disk.
func (bb *bench) bootMF(memMB int) *mfGuest {
	b := bb.b
	dir := guest.FreeShortDir(b)
	g := &mfGuest{memMB: memMB, ram: filepath.Join(shmDir(b), "src.ram"), overlay: guest.NewDisk(b, dir)}
	o := bb.mfOptions(memMB, fileRAMArgs(g.ram, memMB), g.overlay)
	g.vm = guest.Start(b, o)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := g.vm.WaitReady(ctx); err != nil {
		b.Fatalf("guest did not boot: %v\n%s", err, g.vm.SerialTail(20))
	}
	st, err := g.vm.WaitStatus(ctx, func(guest.Status) bool { return true })
	if err != nil {
		b.Fatal(err)
	}
	if st.Mem != st.Mem0 || !strings.HasPrefix(st.Disk, guest.MarkerPrefix) {
		b.Fatalf("source guest is not healthy: %s", st)
	}
	b.Logf("bench: %d MiB guest (RAM file %s) with %d MiB of random data ready %.1fs after QEMU started", memMB, g.ram, benchDataMB, time.Since(g.vm.Started()).Seconds())
	return g
}

func (bb *bench) mfOptions(memMB int, extra []string, disk string) guest.Options {
	return guest.Options{MemMB: memMB, GuestMemMB: benchDataMB, Dir: guest.FreeShortDir(bb.b), ExtraArgs: extra, Disk: disk,
		KernelArgs: []string{fmt.Sprintf("vmsnap.mem_every=%d", benchMemEvery)}, QEMURoot: bb.mfQEMU}
}

// diskPath is a new path beside g's disk (its base's directory).
func (g *mfGuest) diskPath() string {
	g.copies++
	return filepath.Join(filepath.Dir(g.overlay), fmt.Sprintf("target-%d.qcow2", g.copies))
}

// mfTarget starts a QEMU like g's, waiting with -incoming defer, with its
// RAM as extra says and a copy of g's disk (the marker never changes after
// boot).
func (bb *bench) mfTarget(g *mfGuest, extra []string) *guest.VM {
	disk := g.diskPath()
	in, err := os.Open(g.overlay)
	if err != nil {
		bb.b.Fatal(err)
	}
	defer in.Close()
	out, err := os.Create(disk)
	if err != nil {
		bb.b.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		bb.b.Fatal(err)
	}
	if err := out.Close(); err != nil {
		bb.b.Fatal(err)
	}
	return bb.mfTargetDisk(g, extra, disk)
}

func (bb *bench) mfTargetDisk(g *mfGuest, extra []string, disk string) *guest.VM {
	o := bb.mfOptions(g.memMB, extra, disk)
	o.Incoming = true
	return guest.Start(bb.b, o)
}

// settled waits for the guest's next status line (so that a checkpoint
// does not fall on the guest's checksum pass more often in one format than
// the other) and returns it.
func (bb *bench) settled(vm *guest.VM) guest.Status {
	last, _ := vm.LastStatus()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	st, err := vm.WaitStatus(ctx, func(s guest.Status) bool { return s.Counter > last.Counter && s.Counter%benchMemEvery != 0 })
	if err != nil {
		bb.b.Fatal(err)
	}
	return st
}

// mfResumed checks that a restored guest carries on from at (the source's
// last status before the checkpoint): same boot, memory checksums and disk
// marker, counter going on, not booted again.
func (bb *bench) mfResumed(vm *guest.VM, at guest.Status, rs api.RestoreResult) {
	if rs.VMState == nil || !rs.VMState.VMRunning {
		bb.b.Fatalf("restore result: %+v", rs)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	st, err := vm.WaitStatus(ctx, func(s guest.Status) bool { return s.Counter > at.Counter })
	if err != nil || vm.ReadyCount() != 0 || st.Boot != at.Boot || st.Mem0 != at.Mem0 || st.Mem != at.Mem || st.Disk != at.Disk {
		bb.b.Fatalf("the restored guest does not carry on from the source (%v): %s, source %s\n%s", err, st, at, vm.SerialTail(5))
	}
}

// ---- the report -------------------------------------------------------------

func medianDur(d []time.Duration) float64 { return float64(medianD(d)) / float64(time.Millisecond) }

func sumMedian(a, b []time.Duration) float64 {
	var s []time.Duration
	for i := range min(len(a), len(b)) {
		s = append(s, a[i]+b[i])
	}
	return medianDur(s)
}

func passMiss(ok bool) string {
	if ok {
		return "PASS"
	}
	return "MISS"
}

func (r *mfReport) print(w io.Writer, bb *bench) {
	fmt.Fprintf(w, "\n=== vmsnap make bench, memory-file (#15) against stream in one run: %s guests with %d MiB random data, RAM a shared file on /dev/shm; median of %d runs ===\n",
		strings.Join(r.sizeNames(), " and "), benchDataMB, bb.runs)
	fmt.Fprintf(w, "machine: %s; load average %s before, %s after; registry: docker-registry, TLS + htpasswd on 127.0.0.1\n", machineDescription(), r.load0, r.load1)
	fmt.Fprintf(w, "QEMU, both paths: %s\n", bb.mfQEMUName)
	tw := tabwriter.NewWriter(w, 2, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "figure\t%s\ttarget\tverdict\t\n", strings.Join(r.sizeNames(), "\t"))
	rowf := func(name string, f func(s *mfSize) string, target string, verdict func(s *mfSize) bool) {
		var cells []string
		ok := true
		for _, s := range r.sizes {
			cells = append(cells, f(s))
			if verdict != nil {
				ok = ok && verdict(s)
			}
		}
		v := ""
		if verdict != nil {
			v = passMiss(ok)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t\n", name, strings.Join(cells, "\t"), target, v)
	}
	rowf("guest boot (TCG, filling the data)", func(s *mfSize) string { return fmt.Sprintf("%.1f s", s.boot.Seconds()) }, "", nil)
	rowf("file on the node: restore, durationsMs.total", func(s *mfSize) string { return fmt.Sprintf("%.1f ms", medianF(s.warmRestoreMs)) },
		fmt.Sprintf("<= %d ms, same for both", targetWarmRestoreMs), func(s *mfSize) bool { return medianF(s.warmRestoreMs) <= targetWarmRestoreMs })
	rowf("  the same, vmsnap restore process wall time", func(s *mfSize) string { return fmt.Sprintf("%.0f ms", medianDur(s.warmRestore)) }, "", nil)
	rowf("  (prepare finding the file: wall; durationsMs)", func(s *mfSize) string {
		return fmt.Sprintf("%.0f ms; %.1f ms", medianDur(s.warmPrepare), medianF(s.warmPrepareMs))
	}, "", nil)
	rowf("stream restore, command start to running", func(s *mfSize) string { return fmt.Sprintf("%.0f ms", medianDur(s.streamRestore)) }, "", nil)
	rowf("cold: prepare (empty cache) + restore", func(s *mfSize) string {
		return fmt.Sprintf("%.0f ms (%.0f + %.0f)", sumMedian(s.coldPrepare, s.coldRestore), medianDur(s.coldPrepare), medianDur(s.coldRestore))
	}, "", nil)
	rowf("  cold / stream restore", func(s *mfSize) string {
		return fmt.Sprintf("%.2fx", sumMedian(s.coldPrepare, s.coldRestore)/medianDur(s.streamRestore))
	}, "<= 1.00x", func(s *mfSize) bool { return sumMedian(s.coldPrepare, s.coldRestore) <= medianDur(s.streamRestore) })
	rowf("  cold prepare fetched / stream stored", func(s *mfSize) string {
		return fmt.Sprintf("%s / %s", humanBytes(s.coldFetched), humanBytes(s.streamStored))
	}, "", nil)
	rowf("  stream restore into a shared RAM file (once)", func(s *mfSize) string {
		return fmt.Sprintf("%.0f ms (file then %s)", float64(s.streamRestoreFile)/1e6, humanBytes(s.streamRestoreFileAlloc))
	}, "", nil)
	rowf("snapshot mode downtime: stream", func(s *mfSize) string { return fmt.Sprintf("%.0f ms", medianF(s.streamDown)) }, "", nil)
	rowf("snapshot mode downtime: memory-file (a base)", func(s *mfSize) string { return fmt.Sprintf("%.0f ms", medianF(s.mfDown)) }, "", nil)
	rowf("  of which scanning the RAM file", func(s *mfSize) string { return fmt.Sprintf("%.0f ms", medianF(s.mfSave)) }, "", nil)
	rowf("  each run: downtime ms (RAM file allocated)", func(s *mfSize) string {
		var v []string
		for i := range s.mfDown {
			v = append(v, fmt.Sprintf("%.0f (%s)", s.mfDown[i], humanBytes(s.mfAlloc[i])))
		}
		return strings.Join(v, ", ")
	}, "", nil)
	rowf("  memory-file / stream", func(s *mfSize) string { return fmt.Sprintf("%.1f%%", 100*medianF(s.mfDown)/medianF(s.streamDown)) },
		fmt.Sprintf("<= %.0f%%", 100*targetDowntimeShare), func(s *mfSize) bool { return medianF(s.mfDown) <= targetDowntimeShare*medianF(s.streamDown) })
	rowf("snapshot mode checkpoint total: stream; memory-file", func(s *mfSize) string {
		return fmt.Sprintf("%.0f; %.0f ms", medianF(s.streamTotal), medianF(s.mfTotal))
	}, "", nil)
	for i, name := range []string{"idle VM's second checkpoint: uploaded / stored", "5% in 205 scattered 64 KiB pieces: uploaded / stored", "5% contiguous: uploaded / stored"} {
		row := i + 1
		rowf(name, func(s *mfSize) string {
			c := s.chain[row]
			return fmt.Sprintf("%.2f%% (%s / %s)", 100*float64(c.uploaded)/float64(c.stored), humanBytes(c.uploaded), humanBytes(c.stored))
		}, fmt.Sprintf("<= %.0f%%", 100*r.sizes[0].chain[row].target), func(s *mfSize) bool {
			c := s.chain[row]
			return float64(c.uploaded) <= c.target*float64(c.stored)
		})
	}
	rowf("  their downtime (idle, scattered, contiguous)", func(s *mfSize) string {
		return fmt.Sprintf("%.0f, %.0f, %.0f ms", s.chain[1].downtimeMs, s.chain[2].downtimeMs, s.chain[3].downtimeMs)
	}, "", nil)
	trustRows(rowf)
	requestRows(rowf)
	rowf("base + 4 deltas: cold prepare + restore", func(s *mfSize) string {
		return fmt.Sprintf("%.0f ms (%s fetched)", float64(s.chainRestore)/1e6, humanBytes(s.chainFetched))
	}, "exact", func(s *mfSize) bool { return s.exact != "" })
	if c := r.sizes[0].clones; c != nil {
		fmt.Fprintf(tw, "%d clones of one %d MiB image: node memory / one's\t%.2fx (%s / %s)\t\t<= %.1fx\t%s\t\n", benchClones, benchMemMB,
			float64(c.node4())/float64(c.node1()), humanBytes(c.node4()), humanBytes(c.node1()), targetCloneMemory, passMiss(float64(c.node4()) <= targetCloneMemory*float64(c.node1())))
		fmt.Fprintf(tw, "  outside the file: %d QEMUs; one\t%s; %s\t\t\t\t\n", benchClones, humanBytes(c.private4), humanBytes(c.private1))
		fmt.Fprintf(tw, "  the RAM file, allocated: with %d; with one\t%s; %s\t\t\t\t\n", benchClones, humanBytes(c.file4), humanBytes(c.file1))
		fmt.Fprintf(tw, "  sum of Pss: %d; one\t%s; %s (%.2fx)\t\t\t\t\n", benchClones, humanBytes(c.pss4), humanBytes(c.pss1), float64(c.pss4)/float64(c.pss1))
	}
	rss := func(f func(s *mfSize) int64, name string) {
		rowf(name, func(s *mfSize) string { return fmt.Sprintf("%.1f MiB", float64(f(s))/1024) }, "flat (<= 1.1x)", func(s *mfSize) bool {
			return float64(f(s)) <= 1.1*float64(f(r.sizes[0]))
		})
	}
	rss(func(s *mfSize) int64 { return s.rssCkpt }, "vmsnap peak RSS: memory-file checkpoint")
	rss(func(s *mfSize) int64 { return s.rssPrepare }, "vmsnap peak RSS: cold prepare")
	tw.Flush()
	for _, s := range r.sizes {
		fmt.Fprintf(w, "%d MiB: the contiguous rewrite: %s\n  restores with the file on the node, durationsMs.total: %s\n    their prepare phase (median %.1f): %s\n    their stream phase (median %.1f): %s\n  exact: %s\n",
			s.memMB, s.rewriteSpan, msList(s.warmRestoreMs), medianF(s.warmPrepareP), msList(s.warmPrepareP), medianF(s.warmStreamP), msList(s.warmStreamP), s.exact)
	}
	fmt.Fprintf(w, "memory-file section wall time: %v\n\n", r.total.Round(time.Second))
}

func msList(v []float64) string {
	var s []string
	for _, x := range v {
		s = append(s, fmt.Sprintf("%.0f", x))
	}
	return strings.Join(s, " ")
}

func (r *mfReport) sizeNames() []string {
	var n []string
	for _, s := range r.sizes {
		n = append(n, fmt.Sprintf("%d GiB", s.memMB/1024))
	}
	return n
}

func (r *mfReport) metrics(b *testing.B) {
	for _, s := range r.sizes {
		g := fmt.Sprintf("%dG", s.memMB/1024)
		b.ReportMetric(medianF(s.warmRestoreMs), "warm-restore-ms-"+g)
		b.ReportMetric(sumMedian(s.coldPrepare, s.coldRestore)/medianDur(s.streamRestore), "cold/stream-"+g)
		b.ReportMetric(medianF(s.mfDown)/medianF(s.streamDown), "downtime-share-"+g)
		b.ReportMetric(float64(s.rssCkpt)/1024, "rss-ckpt-MiB-"+g)
		b.ReportMetric(medianF(s.trust.snapDown), "verified/recorded-downtime-"+g)
		b.ReportMetric(medianF(s.trust.scan), "verified/recorded-scan-"+g)
	}
	if c := r.sizes[0].clones; c != nil {
		b.ReportMetric(float64(c.node4())/float64(c.node1()), "clones4/1")
	}
}

package e2e

// End-to-end tests through a real registry: Debian's docker-registry
// (distribution 2.8) with TLS from a test CA and htpasswd auth, started by
// internal/testing/registry, and real QEMU guests (TCG).

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
)

// regArgs are the flags that reach the test registry with the right
// credentials.
func regArgs(reg *registry.Registry) []string {
	return []string{"--registry-config", reg.ConfigDir, "--ca-file", reg.CAFile}
}

func with(args []string, more ...string) []string {
	return append(append([]string(nil), args...), more...)
}

func TestRegistryE2ERoundTrip(t *testing.T) {
	t.Parallel()
	guest.Assets(t) // skip before starting a registry if there is no guest
	reg := registry.Start(t)
	dir := guest.FreeShortDir(t)
	src, before := bootSource(t, dir)
	image, diskImage := reg.Host+"/vms/e2e:vm1", reg.Host+"/vms/e2e:vm1-disk"
	cpArgs := []string{"checkpoint", "--qmp", src.QMPPath(), "--image", image,
		"--disk", filepath.Join(dir, "overlay.qcow2"), "--disk-image", diskImage, "--mode", "pause"}

	// Refusals come before the VM is stopped.
	doc := cliError(t, errcode.AuthFailed, with(cpArgs, "--registry-config", reg.WrongConfigDir, "--ca-file", reg.CAFile)...)
	if !strings.Contains(doc.Error.Message, "UNAUTHORIZED: authentication required") || strings.Contains(doc.Error.Message, reg.Password) {
		t.Fatalf("wrong password: %s", doc.Error.Message)
	}
	doc = cliError(t, errcode.RegistryError, with(cpArgs, "--registry-config", reg.ConfigDir)...)
	if !strings.Contains(doc.Error.Message, "--ca-file") {
		t.Fatalf("unknown CA: %s", doc.Error.Message)
	}
	if st := runState(t, src); st != "running" {
		t.Fatalf("the source is %s after refused checkpoints, want running (never stopped)", st)
	}

	start := time.Now()
	cp := cliJSON[api.CheckpointResult](t, with(cpArgs, regArgs(reg)...)...)
	checkpointTime := time.Since(start)
	if !strings.HasPrefix(cp.VMState.Image, reg.Host+"/vms/e2e@sha256:") || cp.Disk == nil || !strings.HasPrefix(cp.Disk.Image, reg.Host+"/vms/e2e@sha256:") {
		t.Fatalf("checkpoint result lacks pinned registry images: %+v", cp)
	}
	if cp.VMState.UploadedBytes == 0 || cp.VMState.UploadedBytes > cp.VMState.StoredBytes {
		t.Fatalf("uploaded %d of %d stored bytes", cp.VMState.UploadedBytes, cp.VMState.StoredBytes)
	}
	resume := src.ResumeCounter()
	src.Kill()

	// The checkpoint (its index, which the tag names) finds both images;
	// no image names another, so distribution 2.8 keeps no referrers tag.
	ins := cliJSON[snapshot.InspectResult](t, with([]string{"inspect", image}, regArgs(reg)...)...)
	if ins.LinkedDisk == nil || ins.LinkedDisk.Digest != cp.Disk.Digest || ins.Checkpoint.Image != cp.Checkpoint.Image || ins.Digest != cp.VMState.Digest {
		t.Fatalf("inspect of the checkpoint does not show its state and disk: %+v", ins)
	}
	if tags := reg.Tags(t, "vms/e2e"); !slices.Equal(slices.Sorted(slices.Values(tags)), []string{"vm1", "vm1-disk"}) {
		t.Fatalf("the repository has the tags %v, want the checkpoint's and the disk's", tags)
	}

	// Restore takes digests only.
	tdir := targetDir(t, dir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	cliError(t, errcode.TagNotAllowed, with([]string{"restore", "--disk-image", diskImage, "--disk", disk}, regArgs(reg)...)...)
	cliError(t, errcode.TagNotAllowed, with([]string{"restore", "--qmp", "/nonexistent", "--image", image}, regArgs(reg)...)...)

	start = time.Now()
	rd := cliJSON[api.RestoreResult](t, with([]string{"restore", "--disk-image", cp.Disk.Image, "--disk", disk}, regArgs(reg)...)...)
	if rd.Disk == nil || rd.Disk.Bytes != cp.Disk.RawBytes {
		t.Fatalf("disk restore: %+v", rd)
	}
	diskTime := time.Since(start)
	target := startTarget(t, tdir, disk, 0)
	start = time.Now()
	rs := cliJSON[api.RestoreResult](t, with([]string{"restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image}, regArgs(reg)...)...)
	stateTime := time.Since(start)
	if rs.VMState == nil || !rs.VMState.VMRunning || rs.VMState.RawBytes != cp.VMState.RawBytes {
		t.Fatalf("state restore: %+v", rs)
	}
	assertResumed(t, target, before, resume, resume)
	t.Logf("round trip through the registry: checkpoint %v (%s raw state -> %s stored, %s disk), disk restore %v, state restore %v",
		checkpointTime.Round(time.Millisecond), humanBytes(cp.VMState.RawBytes), humanBytes(cp.VMState.StoredBytes),
		humanBytes(cp.Disk.StoredBytes), diskTime.Round(time.Millisecond), stateTime.Round(time.Millisecond))
}

// A stopped, unchanged VM checkpointed twice: the second checkpoint finds
// its chunks in the registry and uploads only those it does not have. The
// second is of a paused copy of the first (pausedCopy): the guest does not
// run between the two, so the memory is the same, byte for byte.
func TestRegistryE2ERepeatCheckpointUploadsAlmostNothing(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	reg := registry.Start(t)
	dir := guest.FreeShortDir(t)
	src, _ := bootSource(t, dir)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := src.QMP(ctx, "stop", nil); err != nil {
		t.Fatal(err)
	}
	checkpoint := func(vm *guest.VM, tag string) api.CheckpointResult {
		return cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", vm.QMPPath(),
			"--image", reg.Host + "/vms/repeat:" + tag, "--mode", "snapshot"}, regArgs(reg)...)...)
	}
	first := checkpoint(src, "first")
	src.Kill() // its disk goes to the copy
	vm := pausedCopy(t, reg, guest.Options{Disk: filepath.Join(dir, "overlay.qcow2"), Dir: dir}, first.VMState.Image)
	second := checkpoint(vm, "second")
	a, b := first.VMState, second.VMState
	t.Logf("first checkpoint: %d raw, %d stored, %d uploaded in %.0f ms; second: %d raw, %d stored, %d uploaded (%.2f%%) in %.0f ms",
		a.RawBytes, a.StoredBytes, a.UploadedBytes, first.TotalMs,
		b.RawBytes, b.StoredBytes, b.UploadedBytes, 100*float64(b.UploadedBytes)/float64(b.StoredBytes), second.TotalMs)
	if a.UploadedBytes < a.StoredBytes/2 {
		t.Fatalf("the first checkpoint uploaded only %d of %d bytes: the registry was not empty?", a.UploadedBytes, a.StoredBytes)
	}
	if second.VMRunning || runState(t, vm) == "running" {
		t.Fatal("snapshot mode started a VM that was stopped before it")
	}

	// Exactly the chunks the registry did not have went up: every chunk of
	// the second image that the first one has was skipped, each new one
	// uploaded once.
	have := map[string]bool{}
	for _, l := range manifestFromRegistry(t, reg, a.Image).Layers {
		have[string(l.Digest)] = true
	}
	var want int64
	var fresh []int
	layers := manifestFromRegistry(t, reg, b.Image).Layers
	for i, l := range layers {
		if have[string(l.Digest)] {
			continue
		}
		have[string(l.Digest)] = true
		want += l.Size
		fresh = append(fresh, i)
	}
	if b.UploadedBytes != want {
		t.Fatalf("the second checkpoint uploaded %d bytes; the chunks the registry lacked add up to %d", b.UploadedBytes, want)
	}
	t.Logf("second checkpoint: chunks %v of %d were new", fresh, len(layers))

	// vmsnap sends a stopped VM's memory in one final pass, so the stream
	// of an unchanged VM lays out the same and only the chunks around what
	// differs are new: the device state at the stream's end (the copy's
	// devices went through a load), never the memory. Without
	// content-defined chunks at stable boundaries every chunk would go up
	// again.
	if len(fresh) > 2 {
		t.Fatalf("the second checkpoint of an unchanged VM has %d new chunks of %d (%v), %.1f%% of its stored bytes uploaded; want the device state's alone",
			len(fresh), len(layers), fresh, 100*float64(b.UploadedBytes)/float64(b.StoredBytes))
	}
}

// manifestFromRegistry fetches a pinned image's manifest, verified.
func manifestFromRegistry(t *testing.T, reg *registry.Registry, image string) ocispec.Manifest {
	t.Helper()
	ref, err := ociimage.ParseReference(image)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := ociimage.Open(context.Background(), ref, ociimage.WithCAFile(reg.CAFile), ociimage.WithRegistryConfig(reg.ConfigDir))
	if err != nil {
		t.Fatal(err)
	}
	desc, err := repo.Resolve(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m, err := repo.Manifest(context.Background(), desc)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestRegistryE2ECheckpointAfterAChangeUploadsOnlyTheChange changes a
// stopped guest's memory from the host (its RAM is a shared file) the two
// ways memory changes between checkpoints: 1 MiB of data rewritten in
// place, and 1 MiB of zero pages turned into data, which lengthens the
// migration stream in its middle (QEMU sends a zero page as a few bytes).
// The second checkpoint uploads only the chunks around the changes: chunk
// boundaries are content-defined, so they do not shift after the
// insertion. (With fixed-size chunks everything after it would go up
// again, about half the stream.) The change is made in a paused copy of
// the first checkpoint (pausedCopy): the guest does not run between the
// two, so the host's writes are all that differs.
func TestRegistryE2ECheckpointAfterAChangeUploadsOnlyTheChange(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	reg := registry.Start(t)
	const memMB = 512
	opts := func(ram string) guest.Options {
		return guest.Options{MemMB: memMB, GuestMemMB: 256, Dir: guest.FreeShortDir(t), ExtraArgs: []string{
			"-object", fmt.Sprintf("memory-backend-file,id=mem0,size=%dM,mem-path=%s,share=on", memMB, ram),
			"-machine", "memory-backend=mem0"}}
	}
	vm := guest.Start(t, opts(shmFile(t)))
	if _, err := vm.WaitReady(waitCtx(t)); err != nil {
		t.Fatalf("guest did not boot: %v\n%s", err, vm.SerialTail(20))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := vm.QMP(ctx, "stop", nil); err != nil {
		t.Fatal(err)
	}
	checkpoint := func(vm *guest.VM, tag string) api.VMStateResult {
		return cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", vm.QMPPath(),
			"--image", reg.Host + "/vms/change:" + tag, "--mode", "snapshot",
			// The stream's chunking is under test: auto would read the
			// shared RAM file itself (the memory-file format).
			"--format", "stream"}, regArgs(reg)...)...).VMState
	}
	first := checkpoint(vm, "first")
	vm.Kill()
	ram := shmFile(t)
	vm = pausedCopy(t, reg, opts(ram), first.Image)

	const pages = 256 // 1 MiB
	random, zero := classifyPages(t, ram)
	rewritePages(t, ram, contiguousRun(t, random, pages))
	rewritePages(t, ram, contiguousRun(t, zero, pages))
	second := checkpoint(vm, "second")

	// The chunks after the insertion are the first checkpoint's: nothing
	// shifted.
	have := map[string]bool{}
	for _, l := range manifestFromRegistry(t, reg, first.Image).Layers {
		have[string(l.Digest)] = true
	}
	var newChunks []int
	layers := manifestFromRegistry(t, reg, second.Image).Layers
	for i, l := range layers {
		if !have[string(l.Digest)] {
			newChunks = append(newChunks, i)
		}
	}
	t.Logf("new chunks: %v of %d", newChunks, len(layers))
	// A shifted boundary makes every chunk after the insertion new (with
	// fixed-size chunks, about half the stream); the two changes and the
	// device state make a few, where the chunker takes a few chunks to
	// resynchronize (see below): a third tells the two apart.
	if len(newChunks) > len(layers)/3 {
		t.Fatalf("%d of the %d chunks are new after 2 MiB changed: boundaries shifted", len(newChunks), len(layers))
	}
	share := float64(second.UploadedBytes) / float64(first.StoredBytes)
	t.Logf("first checkpoint: %d raw, %d stored in %d chunks; after 2 MiB changed: %d raw (%+d), %d uploaded = %.1f%% of the first",
		first.RawBytes, first.StoredBytes, first.Chunks, second.RawBytes, second.RawBytes-first.RawBytes, second.UploadedBytes, 100*share)
	// QEMU sends a zero page as its header and one byte, a data page as
	// its header and 4096 bytes.
	if grew := second.RawBytes - first.RawBytes; grew != pages*4095 {
		t.Fatalf("the stream grew by %d bytes; filling %d zero pages should have added %d", grew, pages, pages*4095)
	}
	// 2 MiB of new random data, plus the rest of the chunks they fall in
	// (the pages a guest process owns are scattered in its RAM), plus the
	// device state. Content-defined cuts resynchronize after an insertion
	// within a few chunks, but not always within one: the chunker's simulation (chunker.go) puts 12% of cases
	// past 15%, and a CI run saw 31% (12 of 36 chunks). Fixed-size chunks
	// would send everything after the insertion, about half the stream:
	// 40% still tells the two apart.
	if second.UploadedBytes < 2<<20 || share > 0.40 {
		t.Fatalf("the second checkpoint uploaded %d bytes, %.1f%% of the first's %d; want the 2 MiB changed and at most 40%%",
			second.UploadedBytes, 100*share, first.StoredBytes)
	}
}

// shmFile names a file in /dev/shm for a guest's shared RAM, removed when
// the test ends.
func shmFile(t *testing.T) string {
	t.Helper()
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Fatalf("this test shares the guest's RAM through /dev/shm: %v", err)
	}
	ram := filepath.Join("/dev/shm", fmt.Sprintf("vmsnap-test-%d-%d.ram", os.Getpid(), time.Now().UnixNano()))
	t.Cleanup(func() { os.Remove(ram) })
	return ram
}

// classifyPages returns the indexes of the 4 KiB pages of the RAM file
// whose bytes look uniformly random (a chi-square test on the byte
// histogram) and of those that are all zero, in address order.
func classifyPages(tb testing.TB, path string) (random, zero []int64) {
	f, err := os.Open(path)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 4<<20)
	var off int64
	for {
		n, err := io.ReadFull(f, buf)
		for p := 0; p+4096 <= n; p += 4096 {
			page := buf[p : p+4096]
			if !slices.ContainsFunc(page, func(c byte) bool { return c != 0 }) {
				zero = append(zero, (off+int64(p))/4096)
				continue
			}
			var hist [256]int
			for _, c := range page {
				hist[c]++
			}
			chi := 0
			for _, h := range hist {
				chi += (h - 16) * (h - 16)
			}
			// Uniform: chi/16 is about 255 +- 23.
			if chi/16 < 400 {
				random = append(random, (off+int64(p))/4096)
			}
		}
		off += int64(n)
		if err != nil {
			break
		}
	}
	if len(random) < 1000 || len(zero) < 1000 {
		tb.Fatalf("only %d random-looking and %d zero pages in the guest's RAM", len(random), len(zero))
	}
	return random, zero
}

// contiguousRun returns n pages of the list (page indexes in address order)
// that are adjacent in the guest's RAM, from as near its middle as there
// are: a guest's data pages are scattered, and a change should be one
// stretch of memory.
func contiguousRun(tb testing.TB, pages []int64, n int) []int64 {
	for d := 0; d < len(pages); d++ {
		for _, i := range []int{len(pages)/2 + d, len(pages)/2 - d} {
			if i >= 0 && i+n <= len(pages) && pages[i+n-1]-pages[i] == int64(n-1) {
				return pages[i : i+n]
			}
		}
	}
	tb.Fatalf("no %d adjacent pages among %d", n, len(pages))
	return nil
}

func rewritePages(b testing.TB, path string, pages []int64) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	rng := rand.NewChaCha8([32]byte{byte(len(pages)), byte(len(pages) >> 8)})
	page := make([]byte, 4096)
	for _, p := range pages {
		_, _ = rng.Read(page)
		if _, err := f.WriteAt(page, p*4096); err != nil {
			b.Fatal(err)
		}
	}
}

// contStop sends cont and stop on one QMP connection, back to back: a VM a
// migration left in postmigrate runs for microseconds at most and can be
// migrated again.
func contStop(t testing.TB, path string) {
	t.Helper()
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	r := bufio.NewReader(conn)
	answer := func() string {
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				t.Fatalf("QMP: %v", err)
			}
			if strings.Contains(line, `"return"`) || strings.Contains(line, `"error"`) || strings.Contains(line, `"QMP"`) {
				return line
			}
		}
	}
	answer() // greeting
	conn.Write([]byte(`{"execute":"qmp_capabilities"}` + "\n"))
	answer()
	conn.Write([]byte(`{"execute":"cont"}` + "\n" + `{"execute":"stop"}` + "\n"))
	for range 2 {
		if a := answer(); !strings.Contains(a, `"return"`) {
			t.Fatalf("QMP cont/stop: %s", a)
		}
	}
}

// The registry dies while chunks are being uploaded: the checkpoint fails
// with REGISTRY_ERROR, the VM runs again, and no tag points at a partial
// snapshot.
func TestRegistryE2EKilledMidPush(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	reg := registry.Start(t)
	dir := guest.FreeShortDir(t)
	// More random guest memory and small chunks: hundreds of uploads, so
	// the registry dies well before the end.
	src, _ := bootGuest(t, guest.Options{Disk: guest.NewDisk(t, dir), Dir: dir, GuestMemMB: 96})

	var killedAt atomic.Int64
	done := make(chan struct{})
	go func() {
		for reg.BlobCount() < 3 {
			select {
			case <-done:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
		reg.Kill()
		killedAt.Store(int64(reg.BlobCount()))
	}()
	doc := cliError(t, errcode.RegistryError, with([]string{"checkpoint", "--qmp", src.QMPPath(),
		"--image", reg.Host + "/vms/killed:snap", "--mode", "snapshot", "--chunk-size", "262144"}, regArgs(reg)...)...)
	close(done)
	if killedAt.Load() == 0 {
		t.Fatalf("the checkpoint failed before the registry was killed: %s", doc.Error.Message)
	}
	t.Logf("registry killed after %d blobs; checkpoint error: %s", killedAt.Load(), doc.Error.Message)

	if st := runState(t, src); st != "running" {
		t.Fatalf("the source is %s after a failed checkpoint, want running", st)
	}
	last, _ := src.LastStatus()
	if _, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > last.Counter }); err != nil {
		t.Fatalf("the source does not count after the failed checkpoint: %v", err)
	}

	// The registry back on the same storage: blobs, but no tag.
	reg.Restart(t)
	if tags := reg.Tags(t, "vms/killed"); slices.Contains(tags, "snap") {
		t.Fatalf("a failed checkpoint left the tag: %v", tags)
	}
	if n := reg.BlobCount(); n < int(killedAt.Load()) {
		t.Fatalf("the restarted registry has %d blobs, had %d", n, killedAt.Load())
	}
	cliError(t, errcode.RegistryError, with([]string{"inspect", reg.Host + "/vms/killed:snap"}, regArgs(reg)...)...)

	// The same checkpoint now succeeds.
	cp := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", src.QMPPath(),
		"--image", reg.Host + "/vms/killed:snap", "--mode", "snapshot", "--chunk-size", "262144"}, regArgs(reg)...)...)
	if !cp.VMRunning || !slices.Contains(reg.Tags(t, "vms/killed"), "snap") {
		t.Fatalf("checkpoint after the registry came back: %+v", cp)
	}
}

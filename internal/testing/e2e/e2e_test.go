package e2e

// End-to-end tests: real QEMU guests (TCG), the vmsnap commands as a user
// runs them (the built binary, same flags and JSON), an OCI layout on disk.

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/ocischema"
	"github.com/vmsnap/vmsnap/ociimage"
)

// cli runs vmsnap with args and returns stdout and the exit status.
func cli(t testing.TB, args ...string) ([]byte, int) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := runBinary(t, args, &stdout, &stderr)
	t.Logf("vmsnap %s -> exit %d\n%s%s", strings.Join(args, " "), code, stderr.String(), stdout.String())
	return stdout.Bytes(), code
}

// cliJSON runs vmsnap with --json, expects success and decodes the result.
func cliJSON[T any](t testing.TB, args ...string) T {
	t.Helper()
	out, code := cli(t, append(args, "--json")...)
	if code != 0 {
		t.Fatalf("vmsnap %s failed with exit %d: %s", args[0], code, out)
	}
	var v T
	dec := json.NewDecoder(bytes.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("vmsnap %s printed no valid JSON result: %v\n%s", args[0], err, out)
	}
	return v
}

// cliError runs vmsnap with --json, expects failure with code, and returns
// the error object.
func cliError(t testing.TB, code errcode.Code, args ...string) api.ErrorDoc {
	t.Helper()
	out, exit := cli(t, append(args, "--json")...)
	var doc api.ErrorDoc
	if err := json.Unmarshal(out, &doc); err != nil {
		t.Fatalf("no JSON error object on stdout: %v\n%s", err, out)
	}
	if doc.Error.Code != code || exit != code.ExitStatus() {
		t.Fatalf("got %s (exit %d), want %s (exit %d): %s", doc.Error.Code, exit, code, code.ExitStatus(), doc.Error.Message)
	}
	return doc
}

func runState(t testing.TB, vm *guest.VM) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw, err := vm.QMP(ctx, "query-status", nil)
	if err != nil {
		t.Fatalf("query-status: %v", err)
	}
	var st struct{ Status string }
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	return st.Status
}

// waitCtx bounds a wait for a guest or a tool: a guard against a hang,
// not a measure. A TCG guest's boot is about 20 s of CPU; on a machine
// whose cores are shared with a dozen other busy processes it took more
// than 2 minutes (a 1 GiB QEMU 10 guest in make test).
func waitCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// bootGuest starts a test guest, waits for it to boot and returns its
// first status.
func bootGuest(t *testing.T, o guest.Options) (*guest.VM, guest.Status) {
	t.Helper()
	vm := guest.Start(t, o)
	if _, err := vm.WaitReady(waitCtx(t)); err != nil {
		t.Fatalf("guest did not boot: %v\n%s", err, vm.SerialTail(20))
	}
	st, err := vm.WaitStatus(waitCtx(t), func(guest.Status) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	return vm, st
}

// bootSource boots a test guest with a disk and waits for its first status.
func bootSource(t *testing.T, dir string) (*guest.VM, guest.Status) {
	t.Helper()
	guest.Assets(t)
	vm, st := bootGuest(t, guest.Options{Disk: guest.NewDisk(t, dir), Dir: dir})
	if st.Mem != st.Mem0 || !strings.HasPrefix(st.Disk, guest.MarkerPrefix) {
		t.Fatalf("source guest is not healthy before the checkpoint: %s", st)
	}
	return vm, st
}

// targetDir prepares a directory for a restored overlay: the base image the
// overlay's relative backing file names must be beside it.
func targetDir(t *testing.T, sourceDir string) string {
	t.Helper()
	dir := guest.FreeShortDir(t)
	if err := os.Symlink(filepath.Join(sourceDir, "base.qcow2"), filepath.Join(dir, "base.qcow2")); err != nil {
		t.Fatal(err)
	}
	return dir
}

// startTarget starts a QEMU like the source, waiting with -incoming defer.
func startTarget(t *testing.T, dir, disk string, memMB int) *guest.VM {
	t.Helper()
	return guest.Start(t, guest.Options{Disk: disk, Dir: dir, Incoming: true, MemMB: memMB})
}

// assertResumed checks that the restored guest carries on where the source
// was captured: same boot, same memory, same disk, the counter continuing.
func assertResumed(t *testing.T, target *guest.VM, src guest.Status, minCounter, maxCounter int) guest.Status {
	t.Helper()
	got, err := target.WaitStatus(waitCtx(t), func(guest.Status) bool { return true })
	if err != nil {
		t.Fatalf("restored guest printed no status: %v\nserial: %s\nstderr: %s", err, target.SerialTail(10), target.Stderr())
	}
	if target.ReadyCount() != 0 {
		t.Fatalf("restored guest booted again instead of resuming:\n%s", target.SerialTail(10))
	}
	if got.Boot != src.Boot {
		t.Errorf("boot id %s, want the source's %s", got.Boot, src.Boot)
	}
	if got.Mem != src.Mem0 || got.Mem0 != src.Mem0 {
		t.Errorf("memory checksum %s (at boot %s), want the source's %s", got.Mem, got.Mem0, src.Mem0)
	}
	if got.Disk != src.Disk {
		t.Errorf("disk marker %q, want the source's %q", got.Disk, src.Disk)
	}
	if got.Counter < minCounter || got.Counter > maxCounter {
		t.Errorf("first counter after restore is %d, want %d..%d", got.Counter, minCounter, maxCounter)
	}
	next, err := target.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > got.Counter })
	if err != nil || next.Counter != got.Counter+1 {
		t.Errorf("restored guest does not keep counting: %v, %v", next, err)
	}
	return got
}

func TestE2EPauseModeRoundTrip(t *testing.T) {
	t.Parallel()
	dir := guest.FreeShortDir(t)
	src, before := bootSource(t, dir)
	store := filepath.Join(t.TempDir(), "store")

	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":vm1",
		"--disk", filepath.Join(dir, "overlay.qcow2"), "--disk-image", "oci:"+store+":vm1-disk", "--mode", "pause")
	if cp.VMRunning || runState(t, src) == "running" {
		t.Fatalf("pause mode left the source running (%s)", runState(t, src))
	}
	if cp.Disk == nil || !strings.Contains(cp.VMState.Image, "@sha256:") || !strings.Contains(cp.Disk.Image, "@sha256:") {
		t.Fatalf("checkpoint result lacks pinned images: %+v", cp)
	}
	if cp.VMState.RawBytes < 16<<20 || cp.VMState.StoredBytes >= cp.VMState.RawBytes || cp.VMState.MemoryBytes != 256<<20 {
		t.Fatalf("implausible sizes: %+v (the guest holds 16 MiB of random data in 256 MiB)", cp.VMState)
	}
	resume := src.ResumeCounter()
	src.Kill()

	// inspect of the checkpoint shows both images together; the layout
	// passes the image spec's schemas.
	ins := cliJSON[snapshot.InspectResult](t, "inspect", cp.Checkpoint.Image)
	if ins.VMState == nil || ins.LinkedDisk == nil || ins.LinkedDisk.Digest != cp.Disk.Digest {
		t.Fatalf("inspect does not link the disk image: %+v", ins)
	}
	if checked, err := ocischema.Layout(context.Background(), store); err != nil || checked[ocispec.MediaTypeImageIndex] != 1 || checked[ocispec.MediaTypeImageManifest] != 2 {
		t.Fatalf("the layout against the image spec's schemas: %v, %v", checked, err)
	}

	tdir := targetDir(t, dir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	rd := cliJSON[api.RestoreResult](t, "restore", "--disk-image", cp.Disk.Image, "--disk", disk)
	if rd.Disk == nil || rd.Disk.Bytes != cp.Disk.RawBytes {
		t.Fatalf("disk restore result: %+v", rd)
	}
	target := startTarget(t, tdir, disk, 0)
	rs := cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image)
	if rs.VMState == nil || !rs.VMState.VMRunning || rs.VMState.RawBytes != cp.VMState.RawBytes {
		t.Fatalf("state restore result: %+v", rs)
	}
	if st := runState(t, target); st != "running" {
		t.Fatalf("target is %s after restore", st)
	}
	assertResumed(t, target, before, resume, resume)
}

func TestE2ESnapshotModeKeepsSourceRunning(t *testing.T) {
	t.Parallel()
	dir := guest.FreeShortDir(t)
	src, before := bootSource(t, dir)
	store := filepath.Join(t.TempDir(), "store")
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":snap",
		"--disk", filepath.Join(dir, "overlay.qcow2"), "--disk-image", "oci:"+store+":snap-disk", "--mode", "snapshot")
	if !cp.VMRunning || runState(t, src) != "running" {
		t.Fatal("snapshot mode did not continue the source")
	}
	if cp.DowntimeMs <= 0 {
		t.Fatalf("snapshot mode reports downtime %v ms", cp.DowntimeMs)
	}
	last, _ := src.LastStatus()
	if _, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > last.Counter }); err != nil {
		t.Fatalf("source stopped counting after a snapshot: %v", err)
	}

	tdir := targetDir(t, dir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	cliJSON[api.RestoreResult](t, "restore", "--disk-image", cp.Disk.Image, "--disk", disk)
	target := startTarget(t, tdir, disk, 0)
	cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image)
	// The target resumes at the moment of the snapshot, which is before the
	// source's latest line.
	now, _ := src.LastStatus()
	assertResumed(t, target, before, before.Counter+1, now.Counter+1)
}

func TestE2ELiveModeKeepsSourceRunning(t *testing.T) {
	t.Parallel()
	dir := guest.FreeShortDir(t)
	src, before := bootSource(t, dir)
	// The guest writes its disk only at boot, so a copy taken now matches
	// the memory captured below. (Live mode refuses --disk for that reason.)
	tdir := targetDir(t, dir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	copyFile(t, filepath.Join(dir, "overlay.qcow2"), disk)

	store := filepath.Join(t.TempDir(), "store")
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":live", "--mode", "live")
	if !cp.VMRunning || runState(t, src) != "running" {
		t.Fatal("live mode did not keep the source running")
	}
	t.Logf("live mode: QEMU reports %.0f ms of guest downtime, checkpoint took %.0f ms", cp.DowntimeMs, cp.TotalMs)
	if cp.DowntimeMs < 0 || cp.DowntimeMs > cp.TotalMs {
		t.Fatalf("implausible downtime %v ms for a %v ms checkpoint", cp.DowntimeMs, cp.TotalMs)
	}
	last, _ := src.LastStatus()
	if _, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > last.Counter }); err != nil {
		t.Fatalf("source stopped counting after a live checkpoint: %v", err)
	}
	target := startTarget(t, tdir, disk, 0)
	cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image)
	now, _ := src.LastStatus()
	assertResumed(t, target, before, before.Counter+1, now.Counter+1)

	// Live mode with --disk is refused before the VM is touched.
	cliError(t, errcode.Usage, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":x", "--mode", "live",
		"--disk", filepath.Join(dir, "overlay.qcow2"), "--disk-image", "oci:"+store+":x-disk")
}

// sharedCheckpoint is one snapshot-mode checkpoint of a guest, taken once
// and shared by the tests that only need some valid image to refuse.
var sharedCheckpoint struct {
	once            sync.Once
	srcDir, store   string
	image, diskImg  string
	diskImageDigest string
	err             string
}

func checkpointOnce(t *testing.T) (srcDir, store, image, diskImage string) {
	t.Helper()
	s := &sharedCheckpoint
	s.once.Do(func() {
		dir, err := os.MkdirTemp("", "vmsnap-shared-")
		if err != nil {
			s.err = err.Error()
			return
		}
		// The directory outlives this test: other tests use the image.
		s.srcDir, s.store = dir, filepath.Join(dir, "store")
		src, _ := bootSource(t, dir)
		cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+s.store+":shared",
			"--disk", filepath.Join(dir, "overlay.qcow2"), "--disk-image", "oci:"+s.store+":shared-disk")
		s.image, s.diskImg = cp.VMState.Image, cp.Disk.Image
	})
	if s.image == "" {
		t.Fatalf("the shared checkpoint failed earlier: %s", s.err)
	}
	return s.srcDir, s.store, s.image, s.diskImg
}

func TestMain(m *testing.M) {
	code := m.Run()
	if sharedCheckpoint.srcDir != "" {
		os.RemoveAll(sharedCheckpoint.srcDir)
	}
	os.Exit(code)
}

func TestE2ECompatMismatchIsRefusedBeforeLoading(t *testing.T) {
	t.Parallel()
	srcDir, _, image, diskImage := checkpointOnce(t)
	tdir := targetDir(t, srcDir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	cliJSON[api.RestoreResult](t, "restore", "--disk-image", diskImage, "--disk", disk)
	target := startTarget(t, tdir, disk, 512) // the source has 256 MiB
	doc := cliError(t, errcode.CompatMismatch, "restore", "--qmp", target.QMPPath(), "--image", image)
	if !strings.Contains(strings.Join(doc.Error.Details, "\n"), "memory: snapshot has 256 MiB, target has 512 MiB") {
		t.Fatalf("the mismatch does not name the memory difference: %+v", doc.Error)
	}
	if st := runState(t, target); st != "inmigrate" {
		t.Fatalf("target is %s after a refused restore, want inmigrate (untouched)", st)
	}
}

func TestE2ECorruptChunkIsRefused(t *testing.T) {
	t.Parallel()
	srcDir, store, image, diskImage := checkpointOnce(t)
	ref, err := ociimage.ParseReference(image)
	if err != nil {
		t.Fatal(err)
	}
	layers := manifestLayers(t, store, ref.Digest.Encoded())
	if len(layers) < 3 {
		t.Fatalf("want at least 3 chunks to corrupt a middle one, got %d", len(layers))
	}
	for _, tc := range []struct {
		name  string
		chunk int
		// whether QEMU may have started loading (and so exited)
		qemuTouched bool
	}{{"first chunk", 0, false}, {"middle chunk", len(layers) / 2, true}} {
		t.Run(tc.name, func(t *testing.T) {
			// A private copy of the store, so the shared image stays intact.
			own := filepath.Join(t.TempDir(), "store")
			copyTree(t, store, own)
			flipByte(t, filepath.Join(own, "blobs", "sha256", layers[tc.chunk]))
			tdir := targetDir(t, srcDir)
			disk := filepath.Join(tdir, "overlay.qcow2")
			cliJSON[api.RestoreResult](t, "restore", "--disk-image", diskImage, "--disk", disk)
			target := startTarget(t, tdir, disk, 0)
			cliError(t, errcode.DigestMismatch, "restore", "--qmp", target.QMPPath(), "--image", "oci:"+own+"@"+ref.Digest.String())
			if !tc.qemuTouched {
				if st := runState(t, target); st != "inmigrate" {
					t.Fatalf("target is %s, want inmigrate: a bad first chunk must never reach QEMU", st)
				}
				return
			}
			// QEMU got a truncated stream: it fails the load (QEMU 7.2 exits)
			// and never runs the guest.
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = target.Wait(ctx)
			if !target.Exited() && runState(t, target) == "running" {
				t.Fatal("the target runs a guest from a corrupt snapshot")
			}
			if _, ok := target.LastStatus(); ok {
				t.Fatalf("the target's guest printed a status: %s", target.SerialTail(5))
			}
		})
	}
}

func manifestLayers(t *testing.T, store, manifestHex string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(store, "blobs", "sha256", manifestHex))
	if err != nil {
		t.Fatal(err)
	}
	var m struct{ Layers []struct{ Digest string } }
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range m.Layers {
		out = append(out, strings.TrimPrefix(l.Digest, "sha256:"))
	}
	return out
}

func copyFile(t testing.TB, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func copyTree(t testing.TB, from, to string) {
	t.Helper()
	err := filepath.Walk(from, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(from, p)
		dst := filepath.Join(to, rel)
		if fi.IsDir() {
			return os.MkdirAll(dst, 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(dst, b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func flipByte(t testing.TB, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0x01
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

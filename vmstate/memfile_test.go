package vmstate

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

const fakeRAM = 32 << 20

// fakeFileVM is a fake QEMU whose RAM is the shared file it returns, with
// random data in its first 4 MiB.
func fakeFileVM(t *testing.T) (*qmptest.FakeQEMU, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "ram")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(fakeRAM); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(chunkdata.Random(1, 4<<20), 0); err != nil {
		t.Fatal(err)
	}
	return fakeFileVMAt(t, path)
}

func materialized(t *testing.T, dir string, ref string) []byte {
	t.Helper()
	repo := openLayout(t, ref)
	res, err := Prepare(context.Background(), repo, PrepareOptions{Cache: ramfile.Cache{Dir: filepath.Join(dir, "cache")}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(res.MemoryFile)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Each checkpoint of a VM builds on the last one the node recorded for it,
// whatever tag each goes under (a controller's unique tags included).
func TestMemoryFileCheckpointChainsDeltasOnItsRecord(t *testing.T) {
	q, path := fakeFileVM(t)
	dir := t.TempDir()
	records := &ParentRecords{Dir: filepath.Join(t.TempDir(), "records")}
	base, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm-1"), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir(), Records: records})
	if err != nil {
		t.Fatal(err)
	}
	if base.Config.Format != FormatMemoryFile || base.Config.RAM == nil || len(base.Config.RAM.Chain) != 1 {
		t.Fatalf("auto did not take a memory-file base: %+v", base.Config)
	}
	if !slices.Contains(q.Commands(), "cont") || q.Status() != "running" {
		t.Fatal("snapshot mode did not continue the VM")
	}
	if q.Caps[capIgnoreShared] {
		t.Fatal("x-ignore-shared was left on")
	}
	if base.RAMCapture != CapturePrecopy || base.Downtime <= 0 {
		t.Fatalf("a snapshot of a running VM: capture %q (%s), downtime %v: want a pre-copy", base.RAMCapture, base.RAMCaptureNote, base.Downtime)
	}

	// Rewrite 3 scattered pages; the next checkpoint is a delta of those.
	rng := rand.New(rand.NewPCG(9, 9))
	f, _ := os.OpenFile(path, os.O_RDWR, 0)
	for _, page := range []int64{7, 700, 3000} {
		p := make([]byte, ramfile.PageSize)
		for i := range p {
			p[i] = byte(rng.Uint32())
		}
		f.WriteAt(p, page*ramfile.PageSize)
	}
	f.Close()
	delta, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm-2"), CheckpointOptions{Mode: ModePause, StagingDir: t.TempDir(), Records: records})
	if err != nil {
		t.Fatal(err)
	}
	r := delta.Config.RAM
	if len(r.Chain) != 2 || r.Parent() != base.Manifest.Digest || r.Chain[1].ChangedPages != 3 || delta.RAMParentTrust != ParentRecorded {
		t.Fatalf("second checkpoint is not a 3-page delta on the first, recorded: %+v (%s, %s)", r, delta.RAMParentTrust, delta.RAMParentNote)
	}
	if delta.Stream.UploadedBytes > 256<<10 || delta.Stream.StoredBytes < base.Stream.StoredBytes {
		t.Fatalf("delta uploaded %d bytes, stores %d (base %d)", delta.Stream.UploadedBytes, delta.Stream.StoredBytes, base.Stream.StoredBytes)
	}
	want, _ := os.ReadFile(path)
	if got := materialized(t, dir, "oci:"+dir+"@"+delta.Manifest.Digest.String()); !bytes.Equal(got, want) {
		t.Fatal("base + delta does not give the RAM file back")
	}

	// A chain at its bound starts a fresh base.
	qq, _ := fakeFileVMAt(t, path)
	third, err := Checkpoint(context.Background(), qq.Dial(t), openLayout(t, "oci:"+dir+":vm-3"), CheckpointOptions{Mode: ModeSnapshot, MaxChain: 1, StagingDir: t.TempDir(), Records: records})
	if err != nil {
		t.Fatal(err)
	}
	if len(third.Config.RAM.Chain) != 1 || !strings.Contains(third.RAMParentNote, "fresh base") {
		t.Fatalf("past --max-chain: chain %d, note %q", len(third.Config.RAM.Chain), third.RAMParentNote)
	}
	if got := materialized(t, dir, "oci:"+dir+"@"+third.Manifest.Digest.String()); !bytes.Equal(got, want) {
		t.Fatal("the fresh base does not give the RAM file back")
	}
}

// fakeFileVMAt is a running fake QEMU on an existing RAM file, which it
// maps, as QEMU does (the fake runs in this process). It runs under KVM,
// whose dirty log a pre-copy may trust.
func fakeFileVMAt(t *testing.T, path string) (*qmptest.FakeQEMU, string) {
	qmptest.MapFile(t, path)
	q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 64<<10))
	q.Memory, q.KVM = fakeRAM, true
	q.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: path, Share: true}
	return q, path
}

func TestMemoryFileRefusals(t *testing.T) {
	t.Run("backend smaller than memory", func(t *testing.T) {
		q, _ := fakeFileVM(t)
		q.RAMBackend.Size = fakeRAM / 2
		_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{StagingDir: t.TempDir()})
		if errcode.Of(err) != errcode.Usage || slices.Contains(q.Commands(), "stop") {
			t.Fatalf("got %v (commands %v): want USAGE before the VM is touched", err, q.Commands())
		}
	})
	t.Run("RAM file shorter than the backend", func(t *testing.T) {
		q, path := fakeFileVM(t)
		os.Truncate(path, fakeRAM/2)
		_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{StagingDir: t.TempDir()})
		if errcode.Of(err) != errcode.InvalidInput || q.Status() != "running" {
			t.Fatalf("got %v, VM %s: want INVALID_INPUT and the VM running", err, q.Status())
		}
	})
	t.Run("explicit format without a shared file", func(t *testing.T) {
		q, _ := fakeFileVM(t)
		q.RAMBackend.Share = false
		_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{Format: FormatMemoryFile})
		if errcode.Of(err) != errcode.Usage || !strings.Contains(err.Error(), "share=on") {
			t.Fatalf("got %v: want USAGE saying how to start QEMU", err)
		}
	})
	t.Run("live mode takes the stream", func(t *testing.T) {
		q, _ := fakeFileVM(t)
		res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{Mode: ModeLive})
		if err != nil || res.Config.Format == FormatMemoryFile || res.Config.RAM != nil {
			t.Fatalf("live mode: %v, format %q", err, res.Config.Format)
		}
	})
}

func TestMemoryFileRestoreRefusesATargetNotMappingThePreparedFile(t *testing.T) {
	q, _ := fakeFileVM(t)
	dir := t.TempDir()
	res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{Mode: ModePause, StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	prepared := ramfile.Cache{Dir: "/cache"}.Path(res.Manifest.Digest)
	for name, tc := range map[string]struct {
		backend *qmptest.FakeBackend
		want    string
	}{
		"no backend":      {nil, "names none"},
		"another file":    {&qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: "/elsewhere/ram"}, "not the RAM file of this image"},
		"shared cache":    {&qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: prepared, Share: true}, "share=off"},
		"anonymous":       {&qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-ram"}, "is not one"},
		"another backend": {&qmptest.FakeBackend{ID: "mem1", Type: "memory-backend-file", MemPath: prepared}, "memory backend ID"},
	} {
		t.Run(name, func(t *testing.T) {
			target := qmptest.NewFakeQEMU(t, "inmigrate", nil)
			target.Memory = fakeRAM
			target.Caps[capIgnoreShared] = false
			target.RAMBackend = tc.backend
			_, err := Restore(context.Background(), target.Dial(t), openLayout(t, "oci:"+dir+"@"+res.Manifest.Digest.String()), RestoreOptions{})
			if errcode.Of(err) != errcode.CompatMismatch || !strings.Contains(strings.Join(errcode.DetailsOf(err), "; "), tc.want) {
				t.Fatalf("got %v (%s), want COMPAT_MISMATCH mentioning %q", err, strings.Join(errcode.DetailsOf(err), "; "), tc.want)
			}
			if slices.Contains(target.Commands(), "migrate-incoming") || len(target.Received) != 0 {
				t.Fatal("the refused target was fed")
			}
		})
	}
	// The prepared file, private, and a VM's own copy, shared: load (the
	// device state only).
	ownCopy := filepath.Join("/vms", "vm-1234."+filepath.Base(prepared))
	for _, b := range []*qmptest.FakeBackend{
		{ID: "ram0", Type: "memory-backend-file", MemPath: prepared},
		{ID: "ram0", Type: "memory-backend-file", MemPath: ownCopy, Share: true},
	} {
		target := qmptest.NewFakeQEMU(t, "inmigrate", q.State)
		target.Memory = fakeRAM
		target.Caps[capIgnoreShared] = false
		target.RAMBackend = b
		if _, err := Restore(context.Background(), target.Dial(t), openLayout(t, "oci:"+dir+"@"+res.Manifest.Digest.String()), RestoreOptions{}); err != nil {
			t.Fatalf("%s (share %v) was refused: %v", b.MemPath, b.Share, err)
		}
		if !target.Caps[capIgnoreShared] {
			t.Fatal("the target loaded without x-ignore-shared")
		}
	}
}

// A parent named explicitly (not the node's record) whose layers are not
// what its map says: its own RAM's regions under the victim's whole page
// map, both hashes. The victim's memory agrees with the map, so the
// checkpoint verifies every page it inherits and lists those regions;
// prepare of that pinned digest must refuse the file (the pages do not
// match the victim's hashes) rather than hand the victim's next VM the
// attacker's memory. What naming such a parent can do is make the
// checkpoint unusable, never restore other memory.
func TestMemoryFilePrepareRefusesAForgedParentsPages(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	victim, victimRAM := fakeFileVM(t)
	v1, err := Checkpoint(ctx, victim.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	// As much data as the victim's, so that the declared size does not
	// give it away.
	evilRAM := filepath.Join(t.TempDir(), "evil")
	if err := os.WriteFile(evilRAM, chunkdata.Random(666, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(evilRAM, fakeRAM); err != nil {
		t.Fatal(err)
	}
	attacker, _ := fakeFileVMAt(t, evilRAM)
	e1, err := Checkpoint(ctx, attacker.Dial(t), openLayout(t, "oci:"+dir+":evil"), CheckpointOptions{StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	repo := openLayout(t, "oci:"+dir+":vm")
	vm, err := repo.Manifest(ctx, v1.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	forged, err := repo.Manifest(ctx, e1.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	var layers []ocispec.Descriptor
	for _, l := range forged.Layers {
		if l.MediaType != ociimage.MediaTypeRAMPageMap {
			layers = append(layers, l)
		}
	}
	for _, l := range vm.Layers {
		if l.MediaType == ociimage.MediaTypeRAMPageMap {
			layers = append(layers, l)
		}
	}
	forged.Layers = layers
	fdesc, err := repo.PutManifest(ctx, forged)
	if err != nil {
		t.Fatal(err)
	}
	// The victim, unchanged, checkpoints again on that parent.
	victim2, _ := fakeFileVMAt(t, victimRAM)
	v2, err := Checkpoint(ctx, victim2.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{StagingDir: t.TempDir(), Parent: &fdesc})
	if err != nil {
		t.Fatal(err)
	}
	if v2.Config.RAM.Parent() != fdesc.Digest || v2.RAMParentTrust != ParentVerified {
		t.Fatalf("the victim's checkpoint did not build on the forged parent (%s, %s): the test does not attack anything", v2.Config.RAM.Parent(), v2.RAMParentTrust)
	}
	_, err = Prepare(ctx, openLayout(t, "oci:"+dir+"@"+v2.Manifest.Digest.String()), PrepareOptions{Cache: ramfile.Cache{Dir: filepath.Join(t.TempDir(), "cache")}})
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("prepare of a checkpoint built on a forged parent: %v, want DIGEST_MISMATCH", err)
	}
}

// A QEMU may name any file as its RAM: vmsnap reads only a regular file on
// a RAM filesystem that this QEMU maps, and touches the VM not at all
// otherwise.
func TestMemoryFileReadsOnlyTheFileQEMUMaps(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	unmapped := filepath.Join(t.TempDir(), "other.ram")
	if err := os.WriteFile(unmapped, make([]byte, fakeRAM), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "link.ram")
	os.Symlink(unmapped, link)
	for name, path := range map[string]string{
		"a file QEMU does not map": unmapped,
		"a FIFO":                   fifo,
		"procfs":                   "/proc/self/environ",
		"a link":                   link,
	} {
		t.Run(name, func(t *testing.T) {
			q, _ := fakeFileVM(t)
			q.RAMBackend.MemPath = path
			_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{StagingDir: t.TempDir()})
			if errcode.Of(err) != errcode.InvalidInput {
				t.Fatalf("mem-path %s: got %v, want INVALID_INPUT", path, err)
			}
			if slices.Contains(q.Commands(), "stop") {
				t.Fatal("the VM was stopped before the RAM file was refused")
			}
		})
	}
}

// A snapshot pre-copies only where QEMU's dirty log holds every write the
// guest made: under KVM, or TCG from QEMU 9.0 on. QEMU 7.2 under TCG loses
// writes from it, and its VM is scanned, stopped, from the start: no
// migration while it runs, and the result says why.
func TestMemoryFileSnapshotPrecopiesOnlyWhereTheDirtyLogHoldsEveryWrite(t *testing.T) {
	for _, tc := range []struct {
		name    string
		version [3]int
		kvm     bool
		precopy bool
	}{
		{"QEMU 7.2 under TCG", [3]int{7, 2, 22}, false, false},
		{"QEMU 8.2 under TCG", [3]int{8, 2, 2}, false, false},
		{"QEMU 9.0 under TCG", [3]int{9, 0, 0}, false, true},
		{"QEMU 10.0 under TCG", [3]int{10, 0, 2}, false, true},
		{"QEMU 7.2 under KVM", [3]int{7, 2, 22}, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q, _ := fakeFileVM(t)
			q.Version, q.KVM = tc.version, tc.kvm
			res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir()})
			if err != nil {
				t.Fatal(err)
			}
			cmds := q.Commands()
			stop, migrate := slices.Index(cmds, "stop"), slices.Index(cmds, "migrate")
			if tc.precopy {
				if res.RAMCapture != CapturePrecopy || stop >= 0 {
					t.Fatalf("capture %q (%s), commands %v: want a pre-copy, QEMU stopping the VM itself", res.RAMCapture, res.RAMCaptureNote, cmds)
				}
				return
			}
			if res.RAMCapture != CaptureScan || !strings.Contains(res.RAMCaptureNote, "TCG") || !strings.Contains(res.RAMCaptureNote, "9.0") {
				t.Fatalf("capture %q, note %q: want a scan, saying TCG's dirty log before QEMU 9.0 is why", res.RAMCapture, res.RAMCaptureNote)
			}
			if stop < 0 || migrate < stop {
				t.Fatalf("commands %v: want the VM stopped before any migration (no pre-copy)", cmds)
			}
			if q.Status() != "running" {
				t.Fatalf("the VM is %s after the checkpoint", q.Status())
			}
		})
	}
}

// A pre-copy that fails while the VM still runs (QEMU's migration fails)
// falls back: the checkpoint scans the file with the VM stopped, says why,
// and puts the settings it changed back.
func TestMemoryFileSnapshotFallsBackToAScanWhenThePrecopyFails(t *testing.T) {
	q, _ := fakeFileVM(t)
	q.FailFirstMigrations = 1
	limit := q.DowntimeLimit
	repo := openLayout(t, "oci:"+t.TempDir()+":vm")
	res, err := Checkpoint(context.Background(), q.Dial(t), repo, CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if res.RAMCapture != CaptureScan || !strings.Contains(res.RAMCaptureNote, "pre-copy failed") {
		t.Fatalf("capture %q, note %q: want a scan, saying why", res.RAMCapture, res.RAMCaptureNote)
	}
	if i, j := slices.Index(q.Commands(), "migrate"), slices.Index(q.Commands(), "stop"); i < 0 || j < i {
		t.Fatalf("commands %v: the pre-copy must come first, then the VM stopped for the scan", q.Commands())
	}
	if q.Status() != "running" || q.Caps[capIgnoreShared] || q.DowntimeLimit != limit {
		t.Fatalf("after the fallback: status %s, x-ignore-shared %v, downtime limit %d (was %d)", q.Status(), q.Caps[capIgnoreShared], q.DowntimeLimit, limit)
	}
	if res.Downtime <= 0 || res.Config.RAM == nil || res.Config.RAM.DataBytes == 0 {
		t.Fatalf("the scan's checkpoint: downtime %v, ram %+v", res.Downtime, res.Config.RAM)
	}
}

// A pre-copy whose stream vmsnap cannot read but QEMU completes has
// stopped the VM, and QEMU will not migrate it again until it runs: the
// checkpoint fails, the VM runs again, nothing is tagged, and the settings
// are put back.
func TestMemoryFileSnapshotFailsCleanlyWhenAPrecopyCompletedUnread(t *testing.T) {
	q, _ := fakeFileVM(t)
	q.BadRAMStream = true
	limit := q.DowntimeLimit
	dir := t.TempDir()
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir()})
	if errcode.Of(err) != errcode.QMPError || !strings.Contains(err.Error(), "not a migration stream") || !strings.Contains(err.Error(), "the VM was continued") {
		t.Fatalf("got %v: want QMP_ERROR naming the stream, the VM continued", err)
	}
	if q.Status() != "running" || q.Caps[capIgnoreShared] || q.DowntimeLimit != limit {
		t.Fatalf("after the failure: status %s, x-ignore-shared %v, downtime limit %d (was %d)", q.Status(), q.Caps[capIgnoreShared], q.DowntimeLimit, limit)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "index.json")); strings.Contains(string(b), "ref.name") {
		t.Fatalf("a failed checkpoint tagged an image: %s", b)
	}
}

// A VM with another shared memory backend: x-ignore-shared leaves that one
// out of a migration too, which a pre-copy's rewritten stream would not
// match. The checkpoint scans instead, before any migration.
func TestMemoryFileSnapshotScansAVMWithAnotherSharedBackend(t *testing.T) {
	q, _ := fakeFileVM(t)
	q.SharedMemdevs = []string{"ivshmem0"}
	res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if res.RAMCapture != CaptureScan || !strings.Contains(res.RAMCaptureNote, "ivshmem0") {
		t.Fatalf("capture %q, note %q: want a scan naming the other backend", res.RAMCapture, res.RAMCaptureNote)
	}
	if n := len(slices.DeleteFunc(q.Commands(), func(c string) bool { return c != "migrate" })); n != 1 {
		t.Fatalf("commands %v: want the device state's migration only", q.Commands())
	}
}

// A QEMU that streams without end is cut off at a bound that follows the
// VM's size, the VM left running, nothing staged left behind.
func TestMemoryFileSnapshotBoundsAPrecopyWithoutEnd(t *testing.T) {
	q, _ := fakeFileVM(t)
	q.LieStream = true
	staging := t.TempDir()
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{Mode: ModeSnapshot, StagingDir: staging})
	if errcode.Of(err) != errcode.QMPError || q.Status() != "running" {
		t.Fatalf("got %v, VM %s: want QMP_ERROR and the VM running", err, q.Status())
	}
	t.Log(err)
	if ents, _ := os.ReadDir(staging); len(ents) != 0 {
		t.Fatalf("staging files left behind: %v", ents)
	}
}

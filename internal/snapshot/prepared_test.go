package snapshot

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// A memory-file image staged for an init container holds its device state
// only, under the image's own manifest digest; prepare's record of the RAM
// file is accepted by launch only for that image, with exactly the
// arguments vmsnap derives: the record is in a pod's volume and becomes
// QEMU's command line.
func TestStageAndPreparedArgsMemoryFile(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const size = 8 << 20
	ram := make([]byte, size)
	rand.Read(ram[:4<<20])
	ramPath := filepath.Join(t.TempDir(), "guest.ram")
	if err := os.WriteFile(ramPath, ram, 0o600); err != nil {
		t.Fatal(err)
	}
	qmptest.MapFile(t, ramPath) // as QEMU does: vmsnap reads only a file its QEMU maps
	state := make([]byte, 64<<10)
	rand.Read(state)
	vm := qmptest.NewFakeQEMU(t, "running", state)
	vm.Memory = size
	vm.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: ramPath, Share: true}
	vm.Caps["x-ignore-shared"] = false
	store := filepath.Join(t.TempDir(), "store")
	cp, err := Checkpoint(ctx, CheckpointSpec{QMPPath: vm.Path(), Image: "oci:" + store + ":vm", Mode: "snapshot"})
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "state")
	st, err := Stage(ctx, StageSpec{Image: cp.VMState.Image, Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if st.Digest != cp.VMState.Digest || st.Format != vmspec.FormatMemoryFile || st.Bytes >= 1<<20 {
		t.Fatalf("staged %+v: want the image's digest, the device state only", st)
	}
	var blobBytes int64
	filepath.Walk(filepath.Join(dir, "blobs"), func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			blobBytes += fi.Size()
		}
		return nil
	})
	if blobBytes >= 1<<20 {
		t.Errorf("the staged layout holds %d bytes: RAM regions were staged", blobBytes)
	}
	// Without a prepare, launch is told what to run.
	if _, err := PreparedArgs(ctx, dir); errcode.Of(err) != errcode.Usage || !strings.Contains(err.Error(), "vmsnap prepare") {
		t.Fatalf("no prepare: %v", err)
	}
	res, err := Prepare(ctx, PrepareSpec{Image: cp.VMState.Image, CacheDir: filepath.Join(t.TempDir(), "ram")})
	if err != nil {
		t.Fatal(err)
	}
	if err := WritePrepared(dir, res); err != nil {
		t.Fatal(err)
	}
	prepared, err := PreparedArgs(ctx, dir)
	d, args := prepared.Digest, prepared.QEMUArgs
	if err != nil || d.String() != cp.VMState.Digest || strings.Join(args, " ") != strings.Join(res.QEMUArgs, " ") {
		t.Fatalf("PreparedArgs: %s %q %v; want %s %q", d, args, err, cp.VMState.Digest, res.QEMUArgs)
	}
	// The staged device state streams (what StreamStaged gives QEMU).
	var out strings.Builder
	want := qmptest.RAMStream(vm.RAMBackend, size, true, state) // the device state, as x-ignore-shared frames it
	if err := StreamStaged(ctx, dir, &out, chunk.StreamOptions{}); err != nil || out.String() != string(want) {
		t.Fatalf("StreamStaged: %d bytes, %v; want the %d bytes of device state", out.Len(), err, len(want))
	}

	// Tampered records.
	write := func(r api.PrepareResult) {
		t.Helper()
		b, _ := json.Marshal(r)
		if err := os.WriteFile(filepath.Join(dir, PreparedFile), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	other := filepath.Join(filepath.Dir(res.MemoryFile), "sha256-"+strings.Repeat("ab", 32)+".ram")
	for name, mut := range map[string]func(r *api.PrepareResult){
		"another snapshot's record": func(r *api.PrepareResult) { r.Digest = "sha256:" + strings.Repeat("ab", 32) },
		"an extra QEMU argument":    func(r *api.PrepareResult) { r.QEMUArgs = append(r.QEMUArgs, "-chardev", "file,id=x,path=/etc/passwd") },
		"share=on":                  func(r *api.PrepareResult) { r.QEMUArgs[1] = strings.Replace(r.QEMUArgs[1], "share=off", "share=on", 1) },
		"another file":              func(r *api.PrepareResult) { r.MemoryFile = "/etc/passwd" },
		"another cache file":        func(r *api.PrepareResult) { r.MemoryFile = other },
		"a relative file":           func(r *api.PrepareResult) { r.MemoryFile = "ram/" + filepath.Base(r.MemoryFile) },
	} {
		r := *res
		r.QEMUArgs = append([]string(nil), res.QEMUArgs...)
		mut(&r)
		write(r)
		if prepared, err := PreparedArgs(ctx, dir); errcode.Of(err) != errcode.InvalidInput {
			args := prepared.QEMUArgs
			t.Errorf("%s: %q, %v; want INVALID_INPUT", name, args, err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, PreparedFile), make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := PreparedArgs(ctx, dir); errcode.Of(err) != errcode.InvalidInput {
		t.Errorf("a 1 MiB record: %v, want INVALID_INPUT", err)
	}
	// The file itself gone (a node reboot empties medium: Memory).
	write(*res)
	os.Remove(res.MemoryFile)
	if _, err := PreparedArgs(ctx, dir); errcode.Of(err) != errcode.InvalidInput || !strings.Contains(err.Error(), "not there") {
		t.Errorf("the RAM file removed: %v", err)
	}
}

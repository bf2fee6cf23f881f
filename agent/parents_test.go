package agent_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/forge"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate"
)

// The agent records each VM's last memory-file checkpoint, per pod and
// container: the VM's next checkpoint builds on it whatever tag each goes
// under (a tag planted by someone else included), another VM's never
// does, and a VM whose container is replaced starts over with a base.
func TestAgentMemoryFileRecordsEachVMsLastCheckpoint(t *testing.T) {
	d := containerd.Start(t)
	podsDir, err := os.MkdirTemp("", "p")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(podsDir) })
	c := startAgentPodsDir(t, d, podsDir)
	p := newRAMPod(t, d, podsDir, "tenant-a")
	store := filepath.Join(t.TempDir(), "store")
	run := func(pod *ramPod, tag string) *api.CheckpointResult {
		t.Helper()
		op, err := checkpoint(t, c, api.CheckpointRequest{VM: api.VMRef{PodUID: pod.uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock"},
			Image: "oci:" + store + ":" + tag, Mode: "snapshot"})
		if err != nil || op.State != api.StateSucceeded {
			t.Fatalf("checkpoint to %s: %v, %+v", tag, err, op.Error)
		}
		return op.Checkpoint
	}
	rewrite := func(pod *ramPod) {
		rand.Read(pod.ram[100<<10 : 108<<10])
		if err := os.WriteFile(filepath.Join(pod.vol, "guest.ram"), pod.ram, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	first := run(p, "ckpt-1")
	rewrite(p)
	second := run(p, "ckpt-2")
	if r := second.VMState.RAM; r.Parent != first.VMState.Digest || r.ParentTrust != vmstate.ParentRecorded {
		t.Fatalf("second checkpoint: parent %q (%s; %s), want the first, recorded", r.Parent, r.ParentTrust, r.BaseNote)
	}

	// Someone who may write the repository plants a forged parent under
	// the tag the next checkpoint goes to.
	ctx := context.Background()
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: store})
	if err != nil {
		t.Fatal(err)
	}
	secondDesc, err := repo.ResolveTag(ctx, "ckpt-2")
	if err != nil {
		t.Fatal(err)
	}
	forged, _, err := forge.Parent(ctx, repo, secondDesc, 1<<20, 7, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if err := ociimage.TagManifest(ctx, repo, forged, "ckpt-3"); err != nil {
		t.Fatal(err)
	}
	third := run(p, "ckpt-3")
	if r := third.VMState.RAM; r.Parent != second.VMState.Digest {
		t.Fatalf("third checkpoint: parent %q, want the second (the forged one is %s)", r.Parent, forged.Digest)
	}
	prepared, err := snapshot.Prepare(ctx, snapshot.PrepareSpec{Image: third.VMState.Image, CacheDir: filepath.Join(t.TempDir(), "ram")})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(prepared.MemoryFile); !bytes.Equal(got, p.ram) {
		t.Fatal("the third checkpoint does not restore the pod's memory")
	}

	// Another VM, with the very same memory: a base of its own.
	q := newRAMPod(t, d, podsDir, "tenant-a")
	copy(q.ram, p.ram)
	if err := os.WriteFile(filepath.Join(q.vol, "guest.ram"), q.ram, 0o600); err != nil {
		t.Fatal(err)
	}
	if r := run(q, "other").VMState.RAM; r.Parent != "" || !strings.Contains(r.BaseNote, "no checkpoint of this VM") {
		t.Fatalf("another pod's first checkpoint: parent %q, note %q: want a base", r.Parent, r.BaseNote)
	}

	// The container replaced: its record goes with it (the agent forgets
	// the VM's operations after its record).
	last, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	d.Replace(t, p.c)
	waitForgotten(t, c, last, p.uid)
	if r := run(p, "after-replace").VMState.RAM; r.Parent != "" || !strings.Contains(r.BaseNote, "no checkpoint of this VM") {
		t.Fatalf("after the container was replaced: parent %q, note %q: want a base", r.Parent, r.BaseNote)
	}
}

// waitForgotten waits until the agent no longer knows the operations of
// pod's VM among ops: it has processed the container's removal.
func waitForgotten(t *testing.T, c interface {
	Get(context.Context, string) (api.Operation, error)
}, ops []api.Operation, pod string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		known := 0
		for _, op := range ops {
			if op.VM.PodUID != pod {
				continue
			}
			if _, err := c.Get(ctx, op.ID); err == nil {
				known++
			}
		}
		if known == 0 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal(fmt.Errorf("the agent still knows %d operations of the replaced container", known))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

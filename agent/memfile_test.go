package agent_test

// A memory-file checkpoint through the agent reads the guest's RAM from
// the file QEMU names as its mem-path. QEMU is the tenant's: these tests
// make it name files the agent must never read, against a real containerd
// and the agent's real resolver, and check that the one it may read (a
// file on the pod's own volume) is what the image holds.

import (
	"bytes"
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/agent/containerd"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	testcontainerd "github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

const memfileTestRAM = 8 << 20

// ramPod is a pod whose QEMU container (a fake QEMU with a shared
// memory-backend-file) has an emptyDir at /run/vm in the kubelet's
// directory of the pod, holding its QMP socket and its RAM file guest.ram.
type ramPod struct {
	c   *testcontainerd.Container
	uid string
	vol string // host path of the emptyDir
	vm  *qmptest.FakeQEMU
	ram []byte
}

func newRAMPod(t *testing.T, d *testcontainerd.Daemon, podsDir, namespace string, mounts ...specs.Mount) *ramPod {
	t.Helper()
	p := &ramPod{uid: testcontainerd.NewPodUID()}
	p.vol = filepath.Join(podsDir, p.uid, "volumes", "kubernetes.io~empty-dir", "vm")
	if err := os.MkdirAll(p.vol, 0o755); err != nil {
		t.Fatal(err)
	}
	p.ram = make([]byte, memfileTestRAM)
	rand.Read(p.ram[:1<<20]) // one MiB of data, the rest zero pages
	copy(p.ram[5<<20:], namespace+"'s secret RAM")
	if err := os.WriteFile(filepath.Join(p.vol, "guest.ram"), p.ram, 0o600); err != nil {
		t.Fatal(err)
	}
	state := make([]byte, 64<<10)
	rand.Read(state)
	p.vm = qmptest.NewFakeQEMU(t, "running", state)
	p.vm.Memory = memfileTestRAM
	p.vm.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: "/run/vm/guest.ram", Share: true, HostPath: filepath.Join(p.vol, "guest.ram")}
	p.vm.Caps["x-ignore-shared"] = false
	if err := os.Rename(p.vm.Path(), filepath.Join(p.vol, "qmp.sock")); err != nil {
		t.Fatal(err)
	}
	p.c = d.Create(t, testcontainerd.PodContainer{PodUID: p.uid, PodNamespace: namespace, Name: "qemu", HostDir: p.vol, Mounts: mounts})
	return p
}

func (p *ramPod) setMemPath(memPath string) {
	p.vm.Lock()
	p.vm.RAMBackend.MemPath = memPath
	p.vm.Unlock()
}

func startAgentPodsDir(t *testing.T, d *testcontainerd.Daemon, podsDir string) *agent.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := containerd.New(ctx, d.Address, "", containerd.WithPodsDir(podsDir))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return agent.StartTestAgent(t, r)
}

func TestAgentMemoryFileHostileMemPath(t *testing.T) {
	d := testcontainerd.Start(t)
	podsDir, err := os.MkdirTemp("", "p") // short: the QMP socket's path must fit a sockaddr
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(podsDir) })
	c := startAgentPodsDir(t, d, podsDir)

	victim := newRAMPod(t, d, podsDir, "tenant-a")
	// The attacker's pod spec mounts the victim's emptyDir as a hostPath
	// volume, and its QEMU names files the agent must not read.
	attacker := newRAMPod(t, d, podsDir, "tenant-b",
		specs.Mount{Destination: "/steal", Type: "bind", Source: victim.vol, Options: []string{"rbind"}},
		specs.Mount{Destination: "/host-etc", Type: "bind", Source: "/etc", Options: []string{"rbind", "ro"}})
	if err := os.Symlink(filepath.Join(victim.vol, "guest.ram"), filepath.Join(attacker.vol, "link.ram")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc/passwd", filepath.Join(attacker.vol, "passwd.ram")); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		memPath string
		code    errcode.Code
	}{
		{"/etc/passwd", errcode.InvalidInput},              // the container's root filesystem (the node's, to an agent that followed it)
		{"/host-etc/passwd", errcode.Forbidden},            // a hostPath volume of a node directory
		{"/steal/guest.ram", errcode.Forbidden},            // another pod's volume, through a hostPath
		{"/run/vm/link.ram", errcode.InvalidInput},         // a symbolic link in its own volume, to the victim's file
		{"/run/vm/passwd.ram", errcode.InvalidInput},       // a symbolic link to a node file
		{"/run/vm/../../etc/passwd", errcode.InvalidInput}, // ".."
		{"/proc/1/mem", errcode.InvalidInput},
	} {
		// Under the agent's layout root: the parent test's temporary directory.
		store := filepath.Join(t.TempDir(), "store")
		t.Run(strings.ReplaceAll(tc.memPath, "/", "_"), func(t *testing.T) {
			attacker.setMemPath(tc.memPath)
			op, err := checkpoint(t, c, api.CheckpointRequest{VM: api.VMRef{PodUID: attacker.uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock"},
				Image: "oci:" + store + ":vm", Mode: "pause"})
			if err != nil {
				t.Fatalf("the request itself failed: %v", err)
			}
			if op.State != api.StateFailed || op.Error == nil || errcode.Code(op.Error.Code) != tc.code {
				t.Fatalf("checkpoint with mem-path %s: %s, %+v; want failed with %s", tc.memPath, op.State, op.Error, tc.code)
			}
			if !strings.Contains(op.Error.Message, "RAM file") {
				t.Errorf("the error does not name the RAM file: %s", op.Error.Message)
			}
			// Refused before the VM was touched: never stopped, nothing stored.
			if slices.Contains(attacker.vm.Commands(), "stop") || migrated(attacker.vm) || attacker.vm.Status() != "running" {
				t.Errorf("the attacker's QEMU is %s after %v", attacker.vm.Status(), attacker.vm.Commands())
			}
			if _, err := os.Stat(filepath.Join(store, "index.json")); err == nil {
				if b, _ := os.ReadFile(filepath.Join(store, "index.json")); bytes.Contains(b, []byte("manifests\":[{")) {
					t.Errorf("an image was stored: %s", b)
				}
			}
		})
	}
	if victim.vm.Status() != "running" || len(victim.vm.Srv.Received()) != 0 {
		t.Errorf("the victim's QEMU was reached: %v", victim.vm.Commands())
	}
}

// The RAM file on the pod's own volume is checkpointed, and what the image
// holds is that file, byte for byte.
func TestAgentMemoryFileCheckpointReadsThePodsVolume(t *testing.T) {
	d := testcontainerd.Start(t)
	podsDir, err := os.MkdirTemp("", "p")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(podsDir) })
	c := startAgentPodsDir(t, d, podsDir)
	other := newRAMPod(t, d, podsDir, "tenant-a")
	p := newRAMPod(t, d, podsDir, "tenant-b")

	store := filepath.Join(t.TempDir(), "store")
	op, err := checkpoint(t, c, api.CheckpointRequest{VM: api.VMRef{PodUID: p.uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock"},
		Image: "oci:" + store + ":vm", Mode: "snapshot"})
	if err != nil || op.State != api.StateSucceeded {
		t.Fatalf("checkpoint: %v, %+v", err, op.Error)
	}
	if op.Checkpoint.VMState.Format != "memory-file" {
		t.Fatalf("format %q, want memory-file", op.Checkpoint.VMState.Format)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := snapshot.Prepare(ctx, snapshot.PrepareSpec{Image: op.Checkpoint.VMState.Image, CacheDir: filepath.Join(t.TempDir(), "ram")})
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(res.MemoryFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, p.ram) {
		t.Fatalf("the image's RAM file differs from the pod's (%d bytes, want %d)", len(got), len(p.ram))
	}
	if len(other.vm.Srv.Received()) != 0 {
		t.Errorf("the other pod's QEMU was reached: %v", other.vm.Commands())
	}
}

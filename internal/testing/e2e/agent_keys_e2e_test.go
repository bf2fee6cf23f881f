package e2e

// Whose keys the agent decrypts with, with real parts: the agent binary
// with a --decryption-key-dir of one directory per namespace and the
// node's key at its top, callers in containers of tenant-a, tenant-b and
// the platform (real containerd and runc), the TLS + htpasswd registry.
// Each tenant's VM, and each QEMU waiting for a restore, is a fake QEMU in
// its pod's volume.

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// The attack: tenant-a copies tenant-b's encrypted checkpoint into
// its own repository (it may push there) and asks the agent to restore it
// into its own QEMU. The agent decrypts tenant-a's restore with tenant-a's
// keys only: AUTH_FAILED, and tenant-a's QEMU receives nothing. tenant-b
// restores its own; the platform, an admin, restores the copy with the
// node's key.
func TestAgentE2ERestoreDecryptsOnlyWithTheNamespacesKeys(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	reg := registry.Start(t)
	vmsnapBin := binary(t)

	// The key directory: the node's key at its top, each tenant's in its
	// namespace's directory.
	gen, keys := t.TempDir(), t.TempDir()
	nodeKey, nodePub, nodeID := e2eKey(t, gen, "node", true)
	keyA, _, idA := e2eKey(t, gen, "tenant-a", true)
	keyB, _, idB := e2eKey(t, gen, "tenant-b", false)
	for from, to := range map[string]string{nodeKey: "node.pem", keyA: "tenant-a/key.pem", keyB: "tenant-b/key.pem"} {
		to = filepath.Join(keys, to)
		if err := os.MkdirAll(filepath.Dir(to), 0o700); err != nil {
			t.Fatal(err)
		}
		copyFile(t, from, to)
		if err := os.Chmod(to, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	stateB := bytes.Repeat([]byte("tenant-b's memory "), 1<<14)

	type vm struct {
		uid, qmp string
		q        *qmptest.FakeQEMU
	}
	newVM := func(ns, status string) vm {
		q := qmptest.NewFakeQEMU(t, status, stateB)
		v := vm{uid: containerd.NewPodUID(), q: q, qmp: containerd.DefaultMountPath + "/" + filepath.Base(q.Path())}
		ctrd.Create(t, containerd.PodContainer{PodUID: v.uid, PodNamespace: ns, Name: "qemu", HostDir: filepath.Dir(q.Path())})
		return v
	}
	srcB, inA, inB := newVM("tenant-b", "running"), newVM("tenant-a", "inmigrate"), newVM("tenant-b", "inmigrate")

	sockDir := guest.FreeShortDir(t)
	startAgentProc(t, ctrd, t.TempDir(), filepath.Join(sockDir, "agent.sock"), "--admin-namespace", "platform",
		"--allow-repository", reg.Host+"/vms/{namespace}", "--registry-config", reg.ConfigDir, "--ca-file", reg.CAFile,
		"--decryption-key-dir", keys, "--encrypt-recipient", "jwe:"+nodePub)
	call := func(ns string, v vm, verb string, more ...string) (uint32, []byte) {
		return inPod(t, ctrd, ns, sockDir, vmsnapBin, append([]string{verb, "--agent", "unix:///run/vmsnap/agent.sock",
			"--pod-uid", v.uid, "--container", "qemu", "--qmp", v.qmp, "--json"}, more...)...)
	}

	code, out := call("tenant-b", srcB, "checkpoint", "--image", reg.Host+"/vms/tenant-b/vm:1", "--mode", "snapshot")
	var cp api.CheckpointResult
	if err := json.Unmarshal(out, &cp); err != nil || code != 0 {
		t.Fatalf("tenant-b's checkpoint: exit %d, %v: %s", code, err, out)
	}
	m := manifestFromRegistry(t, reg, cp.VMState.Image)
	want := []string{nodeID, idB}
	slices.Sort(want)
	if got := imgcrypt.EncryptedFor(m.Layers[0]); !slices.Equal(got, want) {
		t.Fatalf("tenant-b's checkpoint is encrypted for %v, want %v (tenant-b's key and the node's)", got, want)
	}

	// tenant-a pushes tenant-b's ciphertext, as stored, into its own repository.
	stolen := copyInRegistry(t, reg, cp.VMState.Image, reg.Host+"/vms/tenant-a/stolen:1")
	code, out = call("tenant-a", inA, "restore", "--image", stolen)
	var doc api.ErrorDoc
	if err := json.Unmarshal(out, &doc); err != nil || doc.Error.Code != errcode.AuthFailed || code != uint32(errcode.AuthFailed.ExitStatus()) ||
		!strings.Contains(doc.Error.Message, idB) || !strings.Contains(doc.Error.Message, "given ("+idA+")") {
		t.Fatalf("tenant-a restoring tenant-b's checkpoint: exit %d, %+v (%v); want AUTH_FAILED, tenant-a's key alone tried", code, doc.Error, err)
	}
	if slices.Contains(inA.q.Commands(), "migrate-incoming") || inA.q.Status() != "inmigrate" {
		t.Fatalf("tenant-a's QEMU was fed: %v, %s", inA.q.Commands(), inA.q.Status())
	}

	if code, out := call("tenant-b", inB, "restore", "--image", cp.VMState.Image); code != 0 || !bytes.Equal(received(inB.q), stateB) {
		t.Fatalf("tenant-b restoring its own checkpoint: exit %d: %s", code, out)
	}
	if code, out := call("platform", inA, "restore", "--image", stolen); code != 0 || !bytes.Equal(received(inA.q), stateB) {
		t.Fatalf("the platform restoring with the node's key: exit %d: %s", code, out)
	}
}

func received(q *qmptest.FakeQEMU) []byte {
	q.WaitMigrations()
	q.Lock()
	defer q.Unlock()
	return q.Received
}

// copyInRegistry copies image as stored into the repository of to (a
// tagged reference in the same registry) and returns the copy, pinned.
func copyInRegistry(t *testing.T, reg *registry.Registry, image, to string) string {
	t.Helper()
	open := func(s string) ociimage.Repository {
		ref, err := ociimage.ParseReference(s)
		if err != nil {
			t.Fatal(err)
		}
		repo, err := ociimage.Open(context.Background(), ref, ociimage.WithCAFile(reg.CAFile), ociimage.WithRegistryConfig(reg.ConfigDir))
		if err != nil {
			t.Fatal(err)
		}
		return repo
	}
	d, err := ociimage.Copy(context.Background(), open(image), open(to), 0, 4)
	if err != nil {
		t.Fatal(err)
	}
	return to[:strings.LastIndex(to, ":")] + "@" + d.Digest.String()
}

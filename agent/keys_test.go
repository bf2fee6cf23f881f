//go:build linux

package agent

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// writeKey writes a new EC private key as a PEM file (mode 0600) and
// returns it as the agent reads it.
func writeKey(t testing.TB, path string) imgcrypt.DecryptionKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKCS8PrivateKey(k)
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	dk, err := imgcrypt.LoadDecryptionKey(path)
	if err != nil {
		t.Fatal(err)
	}
	return dk
}

// keyTenants is an agent with a key directory: the node's key, one for
// tenant-a and one for tenant-b. Each tenant has a running VM and a QEMU
// waiting for a restore.
type keyTenants struct {
	s                  *Server
	h                  http.Handler
	root               string // the layout root
	node, keyA, keyB   imgcrypt.DecryptionKey
	vmA, vmB, inA, inB *qmptest.FakeQEMU
}

const (
	uidInA = "6f1c2a4e-aaa2-4c0e-9a51-0123456789ab"
	uidInB = "6f1c2a4e-bbb2-4c0e-9a51-0123456789ab"
)

func newKeyTenants(t *testing.T) *keyTenants {
	keys := t.TempDir()
	kt := &keyTenants{root: t.TempDir(),
		node: writeKey(t, filepath.Join(keys, "node.pem")),
		keyA: writeKey(t, filepath.Join(keys, "tenant-a", "key.pem")),
		keyB: writeKey(t, filepath.Join(keys, "tenant-b", "key.pem")),
	}
	stateA, stateB := randomState(t, 1<<20), randomState(t, 1<<20)
	kt.vmA, kt.inA = qmptest.NewFakeQEMU(t, "running", stateA), qmptest.NewFakeQEMU(t, "inmigrate", stateB)
	kt.vmB, kt.inB = qmptest.NewFakeQEMU(t, "running", stateB), qmptest.NewFakeQEMU(t, "inmigrate", stateB)
	res := newStaticResolver()
	for uid, vm := range map[string]struct {
		f  *qmptest.FakeQEMU
		ns string
	}{uidA: {kt.vmA, "tenant-a"}, uidInA: {kt.inA, "tenant-a"}, uidB: {kt.vmB, "tenant-b"}, uidInB: {kt.inB, "tenant-b"}} {
		res.vms[uid] = api.Target{PodUID: uid, Container: "qemu", ContainerID: "c-" + uid, QMPPath: vm.f.Path(), Namespace: vm.ns}
	}
	s, err := New(context.Background(), Config{StateDir: t.TempDir(), Resolver: res, LayoutRoot: kt.root, AdminNamespaces: []string{"platform"},
		DecryptionKeyDir: keys, Encrypt: &imgcrypt.EncryptOptions{Recipients: []imgcrypt.Recipient{kt.node.Recipient()}},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	kt.s, kt.h = s, s.Handler()
	return kt
}

// run starts an operation as caller c and waits for its end.
func (kt *keyTenants) run(t *testing.T, c Caller, path, body string) api.Operation {
	t.Helper()
	tn := &tenants{h: kt.h}
	code, b := tn.do(c, "POST", path, body)
	var o api.Operation
	if err := json.Unmarshal(b, &o); err != nil || code != http.StatusAccepted {
		t.Fatalf("%s as %s: %d %s", path, c, code, b)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		op, err := kt.s.ops.get(o.ID)
		if err != nil {
			t.Fatal(err)
		}
		if d := op.snapshot(); d.Done() {
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("operation %s did not end", o.ID)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (kt *keyTenants) restore(t *testing.T, c Caller, uid, image string) api.Operation {
	return kt.run(t, c, "/v1/restores", `{"vm":{"podUID":"`+uid+`","container":"qemu","qmp":"/run/vm/qmp.sock"},"image":"`+image+`"}`)
}

// recipients are the key IDs an image's layers are encrypted for.
func recipients(t *testing.T, image string) []string {
	t.Helper()
	ref, err := ociimage.ParseReference(image)
	if err != nil {
		t.Fatal(err)
	}
	repo, _ := ociimage.Open(context.Background(), ref)
	desc, err := repo.Resolve(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m, err := repo.Manifest(context.Background(), desc)
	if err != nil || len(m.Layers) == 0 {
		t.Fatalf("manifest of %s: %v, %d layers", image, err, len(m.Layers))
	}
	ids := imgcrypt.EncryptedFor(m.Layers[0])
	slices.Sort(ids)
	return ids
}

// The attack: tenant-a copies tenant-b's encrypted checkpoint into
// its own layout and asks the agent to restore it into its own QEMU. The
// agent decrypts a caller's restore only with its namespace's keys, so the
// restore fails with AUTH_FAILED and tenant-a's QEMU receives nothing;
// tenant-b restores its own, and an admin (the node's key) may restore it
// anywhere.
func TestAgentDecryptsOnlyWithTheCallersNamespaceKeys(t *testing.T) {
	kt := newKeyTenants(t)
	// Each tenant's checkpoint is encrypted for its namespace's key and the
	// node's recipient.
	cpB := kt.run(t, callerB, "/v1/checkpoints", `{"vm":{"podUID":"`+uidB+`","container":"qemu","qmp":"/q"},"image":"oci:`+kt.root+`/tenant-b/vm:1","mode":"snapshot"}`)
	cpA := kt.run(t, callerA, "/v1/checkpoints", `{"vm":{"podUID":"`+uidA+`","container":"qemu","qmp":"/q"},"image":"oci:`+kt.root+`/tenant-a/vm:1","mode":"snapshot"}`)
	for _, tc := range []struct {
		op   api.Operation
		want []string
	}{{cpB, []string{kt.keyB.ID, kt.node.ID}}, {cpA, []string{kt.keyA.ID, kt.node.ID}}} {
		if tc.op.State != api.StateSucceeded {
			t.Fatalf("checkpoint: %+v", tc.op.Error)
		}
		slices.Sort(tc.want)
		if got := recipients(t, tc.op.Checkpoint.VMState.Image); !slices.Equal(got, tc.want) {
			t.Fatalf("%s is encrypted for %v, want %v (its namespace's key and the node's)", tc.op.Checkpoint.VMState.Image, got, tc.want)
		}
	}

	// tenant-a copies tenant-b's ciphertext into its own layout, as stored.
	stolen := copyLayoutImage(t, cpB.Checkpoint.VMState.Image, filepath.Join(kt.root, "tenant-a", "stolen"))
	o := kt.restore(t, callerA, uidInA, stolen)
	if o.State != api.StateFailed || o.Error.Code != errcode.AuthFailed || !strings.Contains(o.Error.Message, kt.keyB.ID) ||
		!strings.Contains(o.Error.Message, "given ("+kt.keyA.ID+")") {
		t.Fatalf("tenant-a restoring tenant-b's checkpoint: %s %+v; want AUTH_FAILED naming tenant-b's key, having tried tenant-a's alone", o.State, o.Error)
	}
	if slices.Contains(kt.inA.Commands(), "migrate-incoming") || kt.inA.Status() != "inmigrate" || len(kt.inA.Received) != 0 {
		t.Fatalf("tenant-a's QEMU was fed: %v, %s, %d bytes", kt.inA.Commands(), kt.inA.Status(), len(kt.inA.Received))
	}
	// tenant-b restores its own.
	if o := kt.restore(t, callerB, uidInB, cpB.Checkpoint.VMState.Image); o.State != api.StateSucceeded || kt.inB.Status() != "paused" && kt.inB.Status() != "running" {
		t.Fatalf("tenant-b restoring its own checkpoint: %s %+v", o.State, o.Error)
	}
	// The platform (an admin: the node's key) may move it anywhere.
	if o := kt.restore(t, callerAdmin, uidInA, stolen); o.State != api.StateSucceeded {
		t.Fatalf("an admin restoring with the node's key: %s %+v", o.State, o.Error)
	}
}

// copyLayoutImage copies image (oci:DIR@sha256:...) as stored, encrypted,
// into the layout dir and returns the copy's reference.
func copyLayoutImage(t *testing.T, image, dir string) string {
	t.Helper()
	ref, err := ociimage.ParseReference(image)
	if err != nil {
		t.Fatal(err)
	}
	src, _ := ociimage.Open(context.Background(), ref)
	dst, _ := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir})
	d, err := ociimage.Copy(context.Background(), src, dst, 0, 2)
	if err != nil {
		t.Fatal(err)
	}
	return "oci:" + dir + "@" + d.Digest.String()
}

// Prepare likewise: tenant-a's copy of tenant-b's encrypted memory-file
// image does not materialize in tenant-a's RAM cache; tenant-b's own does,
// in its cache, and an admin filling tenant-a's cache has the node's key.
func TestAgentPrepareDecryptsOnlyWithTheNamespacesKeys(t *testing.T) {
	kt := newKeyTenants(t)
	forB := imgcrypt.WithEncryption(imgcrypt.EncryptOptions{Recipients: []imgcrypt.Recipient{kt.keyB.Recipient(), kt.node.Recipient()}})
	imgB, ram := memoryFileImage(t, filepath.Join(kt.root, "tenant-b", "vm"), 4<<20, forB)
	stolen := copyLayoutImage(t, imgB, filepath.Join(kt.root, "tenant-a", "stolen"))
	prepare := func(c Caller, image, ns string) (*api.PrepareResult, error) {
		return kt.s.prepareAndWait(withCaller(context.Background(), c), api.PrepareRequest{Image: image, Namespace: ns})
	}
	if _, err := prepare(callerA, stolen, ""); errcode.Of(err) != errcode.AuthFailed {
		t.Fatalf("tenant-a preparing tenant-b's image: %v, want AUTH_FAILED", err)
	}
	if files, _ := filepath.Glob(filepath.Join(RAMCacheDir(kt.s.cfg.StateDir, "tenant-a"), "*.ram")); len(files) != 0 {
		t.Fatalf("a refused prepare left %v in tenant-a's cache", files)
	}
	for _, tc := range []struct {
		c         Caller
		image, ns string
	}{{callerB, imgB, ""}, {callerAdmin, stolen, "tenant-a"}} {
		res, err := prepare(tc.c, tc.image, tc.ns)
		if err != nil {
			t.Fatalf("%s preparing %s: %v", tc.c, tc.image, err)
		}
		if got, err := os.ReadFile(res.MemoryFile); err != nil || !slices.Equal(got, ram) {
			t.Fatalf("%s: the prepared RAM file is not the image's memory (%v)", tc.c, err)
		}
	}
}

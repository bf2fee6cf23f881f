package agent

import (
	"context"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	testkeys "github.com/vmsnap/vmsnap/internal/testing/keys"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// keyFiles writes an ECDSA P-256 key pair and returns the private and
// public key files.
func keyFiles(t *testing.T) (priv, pub string) {
	t.Helper()
	priv, pub, _ = testkeys.ECPair(t, t.TempDir(), "cosign")
	return priv, pub
}

// The keys that apply to an image: every --verify-key, plus those of the
// --require-signature entries whose prefix covers its repository
// ({namespace} standing for any namespace, whoever the caller is).
func TestRequireSignatureKeysPerRepository(t *testing.T) {
	_, pubA := keyFiles(t)
	_, pubS := keyFiles(t)
	_, pubAll := keyFiles(t)
	all, err := ociimage.LoadVerifyKey(pubAll)
	if err != nil {
		t.Fatal(err)
	}
	p, err := newSignaturePolicy(nil, []string{"reg.example/tenants/{namespace}=" + pubA, "reg.example/shared=" + pubS})
	if err != nil {
		t.Fatal(err)
	}
	withAll, err := newSignaturePolicy([]ociimage.VerifyKey{all}, []string{"reg.example/shared=" + pubS})
	if err != nil {
		t.Fatal(err)
	}
	d := "@sha256:" + strings.Repeat("ab", 32)
	for _, c := range []struct {
		pol    *signaturePolicy
		caller Caller
		image  string
		want   []string // paths of the keys that apply
	}{
		{p, callerA, "reg.example/tenants/tenant-a/vm" + d, []string{pubA}},
		// A requirement is the repository's, whoever reads it: tenant B
		// may not read tenant A's images unsigned under a broader
		// --allow-repository.
		{p, callerB, "reg.example/tenants/tenant-a/vm" + d, []string{pubA}},
		{p, callerAdmin, "reg.example/tenants/tenant-a/vm" + d, []string{pubA}},
		{p, callerA, "reg.example/shared/vm" + d, []string{pubS}},
		{p, callerA, "reg.example/sharedx/vm" + d, nil},
		{p, callerA, "other.example/shared/vm" + d, nil},
		{p, callerA, "oci:/layouts/tenant-a/vm" + d, nil},
		{withAll, callerA, "reg.example/shared/vm" + d, []string{pubAll, pubS}},
		{withAll, callerA, "oci:/layouts/tenant-a/vm" + d, []string{pubAll}},
	} {
		keys, err := c.pol.keysFor(c.caller, c.image)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, k := range keys {
			got = append(got, k.Path)
		}
		if strings.Join(got, ",") != strings.Join(c.want, ",") {
			t.Errorf("%s for %s: keys %v, want %v", c.image, c.caller, got, c.want)
		}
	}
	for _, bad := range []string{"reg.example/x", "reg.example/x=", "=" + pubA, "reg.example/x:tag=" + pubA, "reg.example/x=" + pubA + ".missing"} {
		if _, err := newSignaturePolicy(nil, []string{bad}); errcode.Of(err) != errcode.Usage {
			t.Errorf("--require-signature %q: %v, want USAGE", bad, err)
		}
	}
}

// An agent with --sign-key signs its checkpoints, and with --verify-key
// restores them; an image it did not sign is refused (AUTH_FAILED)
// before the target QEMU hears of it.
func TestAgentSignsAndRequiresSignatures(t *testing.T) {
	priv, pub := keyFiles(t)
	sk, err := ociimage.LoadSignKey(priv, nil)
	if err != nil {
		t.Fatal(err)
	}
	vk, err := ociimage.LoadVerifyKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	state := randomState(t, 1<<20)
	res := newStaticResolver()
	res.add(uid1, qmptest.NewFakeQEMU(t, "running", state).Path())
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: res, Store: []ociimage.Option{ociimage.WithSigner(sk)}, VerifyKeys: []ociimage.VerifyKey{vk}})
	store := t.TempDir()
	ctx := context.Background()
	op, err := a.client.Checkpoint(ctx, api.CheckpointRequest{VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: "oci:" + store + ":vm"})
	if err != nil {
		t.Fatal(err)
	}
	cp := waitOp(t, a.client, op.ID)
	if cp.State != api.StateSucceeded {
		t.Fatalf("checkpoint %+v", cp.Error)
	}
	restore := func(uid, image string) (api.Operation, *qmptest.FakeQEMU) {
		target := qmptest.NewFakeQEMU(t, "inmigrate", state)
		res.add(uid, target.Path())
		op, err := a.client.Restore(ctx, api.RestoreRequest{VM: api.VMRef{PodUID: uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: image})
		if err != nil {
			t.Fatal(err)
		}
		return waitOp(t, a.client, op.ID), target
	}
	if o, target := restore(uid3, cp.Checkpoint.VMState.Image); o.State != api.StateSucceeded || target.Status() != "running" {
		t.Fatalf("restore of the agent's signed checkpoint: %+v, target %s", o.Error, target.Status())
	}

	unsigned, err := snapshot.Checkpoint(ctx, snapshot.CheckpointSpec{QMPPath: qmptest.NewFakeQEMU(t, "running", state).Path(), Image: "oci:" + store + ":other"})
	if err != nil {
		t.Fatal(err)
	}
	o, target := restore(uid4, unsigned.VMState.Image)
	if o.State != api.StateFailed || o.Error == nil || o.Error.Code != errcode.AuthFailed || !strings.Contains(o.Error.Message, "has no signature") {
		t.Fatalf("restore of an unsigned image: %s %+v, want AUTH_FAILED", o.State, o.Error)
	}
	target.Lock()
	fed := len(target.Received)
	target.Unlock()
	if target.Status() != "inmigrate" || fed != 0 {
		t.Fatalf("the refused image reached the target: %s, %d bytes", target.Status(), fed)
	}
}

//go:build linux

package e2e

// The signing overhead in make bench's stream section (docs/performance.md):
// the pause-mode checkpoint signed (--sign-key) against the plain one, and
// the restore verified (--verify-key) against the plain one, back to back
// in the same run, taking turns going first; and, measured apart in this
// process against the same registry, what one signature and one
// verification cost, and the scrypt of a cosign-encrypted key.

import (
	"context"
	"crypto/ecdsa"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/secure-systems-lab/go-securesystemslib/encrypted"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/keys"
	"github.com/vmsnap/vmsnap/ociimage"
)

// targetSigningRatio: signed within 2% of plain.
const targetSigningRatio = 1.02

// signingReport is the signing part of the bench's report.
type signingReport struct {
	ckpt, restorePre []timed // signed checkpoints, verified restores (RAM preallocated)
	restorePlain     []timed // the plain restores they pair with
	sign, verify     []time.Duration
	kdf              []time.Duration // loading a cosign-encrypted key (scrypt N=2^16)
}

// signingKeys writes the bench's signing key pair (plain PEM, ECDSA
// P-256) and the same key encrypted as cosign generate-key-pair does.
func (bb *bench) signingKeys() {
	dir := bb.b.TempDir()
	var k *ecdsa.PrivateKey
	bb.signKey, bb.signPub, k = keys.ECPair(bb.b, dir, "sign")
	bb.cosignKey = filepath.Join(dir, "cosign.key")
	keys.Cosign(bb.b, bb.cosignKey, k, "bench", encrypted.Standard)
}

// signedCheckpoint is checkpoint with --sign-key, into a fresh repository
// as the plain one's. The key is a plain PEM key: what signing costs,
// without the scrypt of an encrypted one (timed apart, signCosts).
func (bb *bench) signedCheckpoint(vm *guest.VM) (api.CheckpointResult, timed) {
	cp, t := bb.cli(vm, append([]string{"checkpoint", "--qmp", vm.QMPPath(), "--image", bb.repo("vmsnap-signed") + ":state", "--mode", "pause",
		"--sign-key", bb.signKey}, benchCheckpointArgs()...)...)
	qmpOnce(bb.b, vm.QMPPath(), "cont", nil)
	bb.b.Logf("bench: vmsnap checkpoint, signed %v (phases %v); cpu %s", t.d.Round(time.Millisecond), cp.VMState.DurationsMs, t.cpu)
	return cp, t
}

// checkpointTriple runs the plain, encrypted and signed checkpoints of run
// i back to back: the plain one beside each other one, each of those
// going first every other run.
func (bb *bench) checkpointTriple(vm *guest.VM, i int) (cp, ecp, scp api.CheckpointResult, t, et, st timed) {
	if i%2 == 0 {
		scp, st = bb.signedCheckpoint(vm)
		cp, t = bb.checkpoint(vm)
		ecp, et = bb.encryptedCheckpoint(vm)
	} else {
		ecp, et = bb.encryptedCheckpoint(vm)
		cp, t = bb.checkpoint(vm)
		scp, st = bb.signedCheckpoint(vm)
	}
	return
}

// restoreTriple is restorePair of the plain and encrypted images with the
// signed one's verified restore beside the plain one, the signed first
// when the encrypted is last.
func (bb *bench) restoreTriple(image, enc, signed string, src guest.Status, k int) (plain, encrypted, verified timed) {
	if k%2 == 0 {
		verified = bb.restoreState(signed, src, true, "--verify-key", bb.signPub)
		plain, encrypted = bb.restorePair(image, enc, src, false, true)
	} else {
		plain, encrypted = bb.restorePair(image, enc, src, true, true)
		verified = bb.restoreState(signed, src, true, "--verify-key", bb.signPub)
	}
	return plain, encrypted, verified
}

// signCosts times, in this process against the bench's registry, signing
// (Sign of fresh digests, one signature manifest each, as a checkpoint's
// manifest gets) and verification (VerifySignature of the run's signed
// images), n times each, and loading the cosign-encrypted key.
func (bb *bench) signCosts(signed []string, n int) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	key, err := ociimage.LoadSignKey(bb.signKey, nil)
	if err != nil {
		bb.b.Fatal(err)
	}
	pub, err := ociimage.LoadVerifyKey(bb.signPub)
	if err != nil {
		bb.b.Fatal(err)
	}
	ref, err := ociimage.ParseReference(bb.repo("vmsnap-signcost"))
	if err != nil {
		bb.b.Fatal(err)
	}
	repo, err := ociimage.Open(ctx, ref, ociimage.WithRegistryConfig(bb.reg.ConfigDir), ociimage.WithCAFile(bb.reg.CAFile))
	if err != nil {
		bb.b.Fatal(err)
	}
	if err := ociimage.CheckAccess(ctx, repo); err != nil { // the connection, as a checkpoint has it by then
		bb.b.Fatal(err)
	}
	for i := range n {
		d := digest.FromString(fmt.Sprintf("bench signature %d %d", time.Now().UnixNano(), i))
		start := time.Now()
		if err := ociimage.Sign(ctx, repo, ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: d, Size: 1}, key); err != nil {
			bb.b.Fatal(err)
		}
		bb.rep.signing.sign = append(bb.rep.signing.sign, time.Since(start))
	}
	for i := range n {
		r, err := ociimage.ParseReference(signed[i%len(signed)])
		if err != nil {
			bb.b.Fatal(err)
		}
		img, err := ociimage.Open(ctx, r, ociimage.WithRegistryConfig(bb.reg.ConfigDir), ociimage.WithCAFile(bb.reg.CAFile))
		if err != nil {
			bb.b.Fatal(err)
		}
		desc, err := img.Resolve(ctx) // the restore's own request, not timed
		if err != nil {
			bb.b.Fatal(err)
		}
		start := time.Now()
		if err := ociimage.VerifySignature(ctx, img, desc, []ociimage.VerifyKey{pub}); err != nil {
			bb.b.Fatal(err)
		}
		bb.rep.signing.verify = append(bb.rep.signing.verify, time.Since(start))
	}
	for range 3 {
		start := time.Now()
		if _, err := ociimage.LoadSignKey(bb.cosignKey, []byte("bench")); err != nil {
			bb.b.Fatal(err)
		}
		bb.rep.signing.kdf = append(bb.rep.signing.kdf, time.Since(start))
	}
}

// signingOverhead is signed over plain, checkpoint and restore: the median
// of the pairs' ratios of wall time.
func (r *signingReport) overhead(plainCkpt []timed) (ckpt, restore float64) {
	return medianF(pairRatios(plainCkpt, r.ckpt)), medianF(pairRatios(r.restorePlain, r.restorePre))
}

// print is the signing overhead's table.
func (r *signingReport) print(w io.Writer, plainCkpt []timed) {
	fmt.Fprintf(w, "\nsigning overhead: plain and signed (--sign-key, ECDSA P-256 PEM) checkpoints, plain and verified (--verify-key) restores, in pairs, back to back, taking turns going first\n")
	tw := tabwriter.NewWriter(w, 2, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\tpairs\tplain s\tsigned s\tmedian of pair ratios\tratio of medians\tvmsnap CPU s: plain / signed (diff)\tpair ratios\t")
	row := func(name string, plain, signed []timed) { pairRow(tw, name, plain, signed, false) }
	row("checkpoint (command to digest)", plainCkpt, r.ckpt)
	row("restore, target's RAM preallocated", r.restorePlain, r.restorePre)
	tw.Flush()
	ms := func(d []time.Duration) string {
		return fmt.Sprintf("median %.1f ms (%d: %.1f-%.1f)", medianD(d).Seconds()*1000, len(d), minD(d).Seconds()*1000, maxD(d).Seconds()*1000)
	}
	ck, rs := medianD(r.sign).Seconds()/median(plainCkpt).Seconds(), medianD(r.verify).Seconds()/median(r.restorePlain).Seconds()
	fmt.Fprintf(w, "measured apart, against the same registry: one signature (a manifest's, beside its store) %s = %.2f%% of the median plain checkpoint;\n"+
		"one verification %s = %.2f%% of the median plain restore; loading a cosign-encrypted key (scrypt N=2^16, before the VM is touched) %s\n",
		ms(r.sign), 100*ck, ms(r.verify), 100*rs, ms(r.kdf))
	ec, er := r.overhead(plainCkpt)
	fmt.Fprintf(w, "targets: signed checkpoint / plain %.3fx, verified restore / plain %.3fx (<= %.2fx: %s, %s)\n",
		ec, er, targetSigningRatio, verdict(ec <= targetSigningRatio), verdict(er <= targetSigningRatio))
}

func minD(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	return slices.Min(d)
}

func maxD(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	return slices.Max(d)
}

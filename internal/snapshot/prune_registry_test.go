package snapshot

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/prunetest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
)

func registryOpts(reg *registry.Registry) []ociimage.Option {
	return []ociimage.Option{ociimage.WithRegistryConfig(reg.ConfigDir), ociimage.WithCAFile(reg.CAFile)}
}

// TestPruneRegistry: four checkpoints (state and disk in one repository of
// Debian's docker-registry, TLS and htpasswd, deletes enabled), prune
// --keep 2: the kept ones restore exactly; the others' indexes, state and
// disk images answer 404. A checkpoint index names its images, none of them
// has a subject, so the registry holds no referrers fallback tag.
func TestPruneRegistry(t *testing.T) {
	reg := registry.Start(t)
	opts := registryOpts(reg)
	image := reg.Host + "/vms/vm1"
	overlay, cps := fourCheckpoints(t, image, opts)
	tags := slices.Sorted(slices.Values(reg.Tags(t, "vms/vm1")))
	if !slices.Equal(tags, []string{"vm", "vm-disk"}) {
		t.Fatalf("the repository's tags are %v, want the checkpoint's and the disk's only", tags)
	}

	dry, err := Prune(context.Background(), PruneSpec{Repo: image, Keep: 2, Store: opts, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(dry.Removed) != 2 || prunetest.ManifestGone(t, image, cps[0].res.Checkpoint.Digest, opts) || !slices.Equal(slices.Sorted(slices.Values(reg.Tags(t, "vms/vm1"))), tags) {
		t.Fatalf("the dry run removed something, or finds %d to remove", len(dry.Removed))
	}

	res, err := Prune(context.Background(), PruneSpec{Repo: image, Keep: 2, Store: opts})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(prunetest.Digests(res.Kept), checkpointDigests(cps[3], cps[2])) || !slices.Equal(prunetest.Digests(res.Removed), checkpointDigests(cps[1], cps[0])) {
		t.Fatalf("kept %v removed %v", prunetest.Digests(res.Kept), prunetest.Digests(res.Removed))
	}
	for _, cp := range cps[:2] {
		for _, d := range []string{cp.res.Checkpoint.Digest, cp.res.VMState.Digest, cp.res.Disk.Digest} {
			if !prunetest.ManifestGone(t, image, d, opts) {
				t.Fatalf("manifest %s of a removed checkpoint is still in the registry", d)
			}
		}
	}
	for _, cp := range cps[2:] {
		restoresExactly(t, overlay, cp, opts)
	}
	if after := slices.Sorted(slices.Values(reg.Tags(t, "vms/vm1"))); !slices.Equal(after, tags) {
		t.Fatalf("the tags of the kept checkpoint changed: %v", after)
	}
}

// TestPruneRegistryThatRefusesDeletes: distribution's default config
// refuses deletes; prune says so, with what to change, and deletes nothing.
func TestPruneRegistryThatRefusesDeletes(t *testing.T) {
	reg := registry.Start(t, registry.WithDeletesDisabled())
	opts := registryOpts(reg)
	image := reg.Host + "/vms/vm1"
	_, cps := fourCheckpoints(t, image, opts)
	_, err := Prune(context.Background(), PruneSpec{Repo: image, Keep: 2, Store: opts})
	if errcode.Of(err) != errcode.RegistryError || !errors.Is(err, ociimage.ErrDeletesDisabled) ||
		!strings.Contains(err.Error(), "this registry does not allow deletes: enable storage.delete in its config") {
		t.Fatalf("prune on a registry without deletes: %v (%s)", err, errcode.Of(err))
	}
	for _, cp := range cps {
		for _, d := range []string{cp.res.VMState.Digest, cp.res.Disk.Digest} {
			if prunetest.ManifestGone(t, image, d, opts) {
				t.Fatalf("manifest %s is gone", d)
			}
		}
	}
	// A registry that is down is another failure, not this one.
	reg.Stop()
	_, err = Prune(context.Background(), PruneSpec{Repo: image, Keep: 2, Store: append(opts, ociimage.WithRetry(1, 0))})
	if err == nil || errors.Is(err, ociimage.ErrDeletesDisabled) || strings.Contains(err.Error(), "does not allow deletes") {
		t.Fatalf("prune against a stopped registry: %v", err)
	}
}

// TestPruneRegistryInterruptedAtEveryStep: on a real registry, a prune
// stopped before each of its deletions in turn leaves both kept
// checkpoints restorable, and a second prune removes everything the first
// did not reach.
func TestPruneRegistryInterruptedAtEveryStep(t *testing.T) {
	reg := registry.Start(t)
	opts := registryOpts(reg)
	interrupted := errors.New("interrupted")
	for stop := 1; ; stop++ {
		image := reg.Host + "/vms/vm" + string(rune('a'+stop))
		overlay, cps := fourCheckpoints(t, image, opts)
		n := 0
		pruneStep = func(string) error {
			if n++; n == stop {
				return interrupted
			}
			return nil
		}
		_, err := Prune(context.Background(), PruneSpec{Repo: image, Keep: 2, Store: opts})
		pruneStep = nil
		if err == nil {
			if stop < 5 {
				t.Fatalf("the prune had only %d steps", stop-1)
			}
			break
		}
		if !errors.Is(err, interrupted) {
			t.Fatalf("step %d: %v", stop, err)
		}
		for _, cp := range cps[2:] {
			restoresExactly(t, overlay, cp, opts)
		}
		res, err := Prune(context.Background(), PruneSpec{Repo: image, Keep: 2, Store: opts})
		if err != nil || len(res.Kept) != 2 {
			t.Fatalf("prune after an interruption at step %d: %+v, %v", stop, res, err)
		}
		for _, cp := range cps[:2] {
			for _, d := range []string{cp.res.Checkpoint.Digest, cp.res.VMState.Digest, cp.res.Disk.Digest} {
				if !prunetest.ManifestGone(t, image, d, opts) {
					t.Fatalf("after an interruption at step %d and a second prune, %s is still there", stop, d)
				}
			}
		}
	}
}

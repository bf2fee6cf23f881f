package vmstate

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// How far a memory-file delta trusts its parent's page map
// (CheckpointResult.RAMParentTrust).
const (
	ParentRecorded = "recorded" // the node's record of this VM: its own map of the VM's memory
	ParentVerified = "verified" // another: each page it vouched for checked against memory (SHA-256)
)

// parentImage is the checkpoint a delta builds on: its manifest, config
// and RAM layers, and its page map as the capture uses it.
type parentImage struct {
	desc  ocispec.Descriptor
	cfg   Config
	ram   ramfile.Layers
	index *ramfile.Index // the chain's, which a delta's index extends
	trust string
	ramfile.Parent
}

// findParent picks the parent of a memory-file checkpoint of the VM whose
// RAM file is f ("Trust in the parent" in docs/memory-file.md):
//
//   - opts.Parent if given: trusted if it is the checkpoint the node
//     recorded for this VM, else verified against the VM's memory;
//   - else the checkpoint the node recorded for this VM (opts.Records),
//     trusted: the node computed its map from this VM's memory;
//   - else none: a base. The reference's tag is never asked: whoever may
//     write it could name a parent whose map vouches for other memory.
//
// A parent that cannot carry the delta (another format or size, a chain
// at its bound, other encryption) gives a base saying why; one asked for
// is an error.
func findParent(ctx context.Context, repo ociimage.Repository, opts CheckpointOptions, be *RAMBackend, f *os.File) (*parentImage, string, error) {
	rec, why := opts.Records.load(f, be, repo)
	explicit := opts.Parent != nil
	var desc ocispec.Descriptor
	switch {
	case explicit:
		desc = *opts.Parent
	case rec != nil:
		desc = rec.image
	default:
		return nil, why, nil
	}
	refuse := func(why string) (*parentImage, string, error) {
		if explicit {
			return nil, "", errcode.New(errcode.Usage, "the parent %s cannot carry this checkpoint's delta: %s (leave %s out to take a base)", desc.Digest, why, errcode.Field("parent"))
		}
		return nil, why + ": a fresh base", nil
	}
	p, why, err := loadParent(ctx, repo, desc, be, opts.maxChain())
	if err != nil && explicit {
		return nil, "", err
	}
	switch {
	case err != nil:
		return refuse(fmt.Sprintf("the VM's last checkpoint %s could not be read (%v)", desc.Digest, err))
	case why != "":
		return refuse(why)
	}
	if rec != nil && rec.image.Digest == p.desc.Digest {
		p.trust, p.Parent = ParentRecorded, ramfile.Parent{Map: rec.pageMap}
		return p, "", nil
	}
	// Its map is bounded by the VM's own memory (loadParent checked the
	// sizes agree).
	m, err := ramfile.LoadPageMap(ctx, p.ram, repo, p.cfg.RAM.Bytes)
	if err != nil {
		return nil, "", err
	}
	p.trust, p.Parent = ParentVerified, ramfile.Parent{Map: m, Verify: true}
	return p, "", nil
}

// loadParent reads the checkpoint desc names (its index or its VM state
// manifest) as a parent for a delta of backend be: an error if it cannot
// be read, why not if it cannot be one.
func loadParent(ctx context.Context, repo ociimage.Repository, desc ocispec.Descriptor, be *RAMBackend, maxChain int) (*parentImage, string, error) {
	desc, err := ociimage.StateManifest(ctx, repo, desc)
	if err != nil {
		return nil, "", err
	}
	m, err := repo.Manifest(ctx, desc)
	if err != nil {
		return nil, "", err
	}
	if m.ArtifactType != ociimage.ArtifactTypeVMState {
		return nil, "it is not a VM state image", nil
	}
	_, pm, cfg, err := LoadConfig(ctx, ociimage.Pinned(repo, desc))
	if err != nil {
		return nil, "", err
	}
	switch {
	case cfg.Format != FormatMemoryFile:
		return nil, fmt.Sprintf("it is in the %s format", cfg.formatName()), nil
	case cfg.RAM.Backend != be.ID || cfg.RAM.Bytes != be.Bytes:
		return nil, fmt.Sprintf("its RAM is backend %s of %d MiB, this VM's is %s of %d MiB", cfg.RAM.Backend, cfg.RAM.Bytes>>20, be.ID, be.Bytes>>20), nil
	case len(cfg.RAM.Chain) > maxChain:
		return nil, fmt.Sprintf("its chain already holds %d deltas, the most allowed (%s)", len(cfg.RAM.Chain)-1, errcode.Field("maxChain")), nil
	}
	if why, err := encryptionChange(ctx, repo, desc); err != nil || why != "" {
		return nil, why, err
	}
	_, ram, err := cfg.checkRAM(pm.Layers)
	if err != nil {
		return nil, "", err
	}
	p := &parentImage{desc: desc, cfg: cfg, ram: ram}
	why, err := p.loadIndex(ctx, repo)
	return p, why, err
}

// encryptionChange says why this checkpoint may not list the parent's
// layers ("" if it may): a delta is read with the keys that read its
// parent, so both must be encrypted for the same recipients, or both be
// in the clear. Otherwise an encrypted image would reference plaintext
// layers, a plaintext one need a key, or a recipient added since could
// not read the parent's pages while one removed still could.
func encryptionChange(ctx context.Context, repo ociimage.Repository, desc ocispec.Descriptor) (string, error) {
	stored, err := ociimage.Underlying(repo).Manifest(ctx, desc)
	if err != nil {
		return "", err
	}
	was, uniform := imgcrypt.LayersEncryptedFor(stored.Layers)
	now := imgcrypt.EncryptsFor(repo)
	name := func(ids []string) string {
		if ids == nil {
			return "stored in the clear"
		}
		return "encrypted for " + strings.Join(ids, ", ")
	}
	switch {
	case !uniform:
		return "its layers are not all encrypted for the same recipients", nil
	case (was == nil) != (now == nil) || !slices.Equal(was, now):
		return fmt.Sprintf("its layers are %s, this checkpoint's are %s", name(was), name(now)), nil
	}
	return "", nil
}

package snapshot

import (
	"context"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// StagedTag names the VM state image Stage puts in a directory, for
// StreamStaged (vmsnap stream --dir) to find.
const StagedTag = "vmstate"

// StageSpec pulls and verifies a VM state image into a directory (an init
// container's job), refusing an image larger than MaxBytes.
type StageSpec struct {
	Image    string // REF@sha256:...
	Dir      string
	AllowTag bool
	MaxBytes int64
	Workers  int // blobs fetched at once (0: DefaultStageWorkers)
	Store    []ociimage.Option
}

// Stage copies a VM state image into Dir as an OCI layout, every blob
// verified, its config and chunk list checked as a restore would.
func Stage(ctx context.Context, s StageSpec) (*api.StagedState, error) {
	if s.Image == "" || s.Dir == "" {
		return nil, errcode.New(errcode.Usage, "staging needs an image reference and a directory")
	}
	src, cp, err := openPinned(ctx, s.Image, "image", ociimage.PartVMState, s.AllowTag, s.Store)
	if err != nil {
		return nil, err
	}
	// Check the image before copying a byte of its chunks.
	desc, m, cfg, err := vmstate.LoadConfig(ctx, src)
	if err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(s.Dir)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "staging directory %s", s.Dir)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the staging directory")
	}
	dst, err := ociimage.Open(ctx, ociimage.Reference{Layout: dir})
	if err != nil {
		return nil, err
	}
	pinned := ociimage.Pinned(src, desc)
	// A memory-file image's RAM is prepared as a file (vmsnap prepare),
	// not streamed: only its device state is staged. The manifest is the
	// same, so the staged digest is the image's.
	var keep func(ocispec.Descriptor) bool
	if cfg.Format == vmspec.FormatMemoryFile {
		keep = func(l ocispec.Descriptor) bool { return !ramfile.IsRAMLayer(l) }
	}
	copied, err := ociimage.CopyLayers(ctx, pinned, dst, s.MaxBytes, stageWorkers(s.Workers), keep)
	if err != nil {
		return nil, err
	}
	if err := ociimage.TagManifest(ctx, dst, copied, StagedTag); err != nil {
		return nil, err
	}
	st := &api.StagedState{Image: pinned.Reference().String(), Digest: desc.Digest.String(), Checkpoint: checkpointRef(cp), Dir: dir, Bytes: sizeOf(m, keep), Format: cfg.Format}
	return st, nil
}

// DefaultStageWorkers is how many blobs Stage fetches at once unless told:
// an init container has nothing else to do, and each holds one chunk.
// It is a default, not a floor: --workers 1 fetches one at a time.
const DefaultStageWorkers = 4

// stageWorkers honours a caller's count (--workers 1 fetches one blob at a
// time) and defaults the unset one.
func stageWorkers(n int) int {
	if n <= 0 {
		return DefaultStageWorkers
	}
	return n
}

func sizeOf(m ocispec.Manifest, keep func(ocispec.Descriptor) bool) int64 {
	n := m.Config.Size
	for _, l := range m.Layers {
		if keep == nil || keep(l) {
			n += l.Size
		}
	}
	return n
}

// StagedDigest is the digest of the VM state image Stage put in dir: what
// a launcher marks as loaded.
func StagedDigest(ctx context.Context, dir string) (digest.Digest, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", errcode.Wrap(errcode.Usage, err, "%s %s", errcode.Field("stateDir"), dir)
	}
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: abs, Tag: StagedTag})
	var desc ocispec.Descriptor
	if err == nil {
		desc, err = repo.Resolve(ctx)
	}
	if err != nil {
		return "", errcode.Wrap(errcode.InvalidInput, err, "no VM state staged in %s (did the restore init container run with %s %s?)", dir, errcode.Field("toDir"), dir)
	}
	return desc.Digest, nil
}

// StagedConfig is the digest and config of the VM state image Stage put
// in dir.
func StagedConfig(ctx context.Context, dir string) (digest.Digest, vmstate.Config, error) {
	d, err := StagedDigest(ctx, dir)
	if err != nil {
		return "", vmstate.Config{}, err
	}
	abs, _ := filepath.Abs(dir)
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: abs, Digest: d})
	if err != nil {
		return "", vmstate.Config{}, err
	}
	_, _, cfg, err := vmstate.LoadConfig(ctx, repo)
	return d, cfg, err
}

// StreamStaged writes the raw VM state staged in dir to w, verifying every
// chunk again (the volume may have been tampered with since).
func StreamStaged(ctx context.Context, dir string, w interface{ Write([]byte) (int, error) }, o chunk.StreamOptions) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return errcode.Wrap(errcode.Usage, err, "%s %s", errcode.Field("dir"), dir)
	}
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: abs, Tag: StagedTag})
	if err != nil {
		return err
	}
	_, m, cfg, err := vmstate.LoadConfig(ctx, repo)
	if err != nil {
		return err
	}
	if cfg.Format == vmspec.FormatMappedRAM {
		return errcode.New(errcode.CompatMismatch,
			"the staged image is in the mapped-ram format, which QEMU loads from a file, not from a stream: restore it with vmsnap restore --qmp into a QEMU 9.0 or later waiting with -incoming defer")
	}
	layers := m.Layers
	if cfg.Format == vmspec.FormatMemoryFile {
		// The device state only: QEMU maps the RAM file vmsnap prepare
		// made (and must run with x-ignore-shared).
		layers = nil
		for _, l := range m.Layers {
			if !ramfile.IsRAMLayer(l) {
				layers = append(layers, l)
			}
		}
	}
	_, err = chunk.DecodeStream(ctx, layers, repo, w, o)
	return err
}

package disk

import (
	"bytes"
	"context"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// DiskConfig is the config blob of a disk overlay image: enough to check,
// before a byte is written at the target, that the overlay will fit the
// VM recorded beside it.
type DiskConfig struct {
	Format        string    `json:"format"` // always "qcow2"
	Version       uint64    `json:"version"`
	VirtualSize   uint64    `json:"virtualSize"`
	ClusterSize   uint64    `json:"clusterSize"`
	BackingFile   string    `json:"backingFile,omitempty"` // relative to the overlay
	BackingFormat string    `json:"backingFormat,omitempty"`
	FileSize      int64     `json:"fileSize"`
	Created       time.Time `json:"created"`
}

// Inspect reads and validates the qcow2 header of an overlay that is
// to be captured, from f (open for reading), and returns it with the
// file's size. name is what messages call the overlay.
func Inspect(f *os.File, name string) (Header, int64, error) {
	fi, err := f.Stat()
	if err != nil {
		return Header{}, 0, errcode.Wrap(errcode.Internal, err, "stat %s", name)
	}
	if !fi.Mode().IsRegular() {
		return Header{}, 0, errcode.New(errcode.InvalidInput, "disk overlay %s is not a regular file", name)
	}
	h, err := ReadHeader(f, fi.Size())
	if err != nil {
		return h, 0, err
	}
	return h, fi.Size(), h.Validate()
}

// CaptureResult is what Capture stored.
type CaptureResult struct {
	Manifest ocispec.Descriptor
	Image    ociimage.Reference // pinned by digest
	Config   DiskConfig
	Stream   chunk.StreamResult
	Duration time.Duration
}

// Capture stores the qcow2 overlay f (open for reading) as a disk image in
// repo, chunked and compressed like VM state. The header checked and the
// bytes stored are read from this one descriptor, by offset, never by
// name: a path swapped meanwhile changes nothing. name is the overlay's
// path as its user sees it (inside the container, through the agent): it
// goes into the image's annotations, so it must not be a node's host path.
// The VM must not be writing to it: call it while the VM is stopped
// (vmstate.CheckpointOptions.WhileStopped). Like any PutManifest, the
// manifest is tagged only if repo's reference has a tag: a checkpoint
// passes an untagged repository and moves the tag once all its images are
// stored (ociimage.TagManifest).
func Capture(ctx context.Context, f *os.File, name string, repo ociimage.Repository, opts chunk.StreamOptions) (*CaptureResult, error) {
	start := time.Now()
	h, size, err := Inspect(f, name)
	if err != nil {
		return nil, err
	}
	stream, err := chunk.EncodeStream(ctx, io.NewSectionReader(f, 0, math.MaxInt64), repo, opts)
	if err != nil {
		return nil, err
	}
	if stream.RawBytes != size {
		return nil, errcode.New(errcode.Internal, "disk overlay %s changed size while it was captured (%d, now %d bytes): is the VM still running?", name, size, stream.RawBytes)
	}
	cfg := DiskConfig{
		Format: "qcow2", Version: h.Version, VirtualSize: h.VirtualSize, ClusterSize: h.ClusterSize(),
		BackingFile: h.BackingFile, BackingFormat: h.BackingFormat, FileSize: stream.RawBytes,
		Created: time.Now().UTC(),
	}
	desc, err := ociimage.PushArtifact(ctx, repo, ociimage.Artifact{
		ArtifactType:    ociimage.ArtifactTypeDisk,
		ConfigMediaType: ociimage.MediaTypeDiskConfig,
		Config:          cfg,
		Layers:          stream.Layers,
		Annotations: map[string]string{
			ociimage.AnnotationDiskPath: name,
			ociimage.AnnotationRawBytes: strconv.FormatInt(stream.RawBytes, 10),
			ociimage.AnnotationCreated:  cfg.Created.Format(time.RFC3339),
			ociimage.AnnotationTitle:    filepath.Base(name),
		},
	})
	if err != nil {
		return nil, errcode.Ensure(errcode.RegistryError, err, "storing the disk manifest")
	}
	return &CaptureResult{
		Manifest: desc, Image: repo.Reference().WithDigest(desc.Digest), Config: cfg,
		Stream: stream, Duration: time.Since(start),
	}, nil
}

// LoadDiskConfig fetches and checks a disk image's manifest and config.
func LoadDiskConfig(ctx context.Context, repo ociimage.Repository) (ocispec.Descriptor, ocispec.Manifest, DiskConfig, error) {
	var cfg DiskConfig
	desc, m, err := ociimage.PullArtifact(ctx, repo, ociimage.ArtifactTypeDisk, &cfg)
	if err != nil {
		return desc, m, cfg, err
	}
	if cfg.Format != "qcow2" {
		return desc, m, cfg, errcode.New(errcode.InvalidInput, "disk image holds format %q; vmsnap restores qcow2 overlays", cfg.Format)
	}
	total, err := chunk.ValidateLayers(m.Layers)
	if err != nil {
		return desc, m, cfg, err
	}
	if total != cfg.FileSize {
		return desc, m, cfg, errcode.New(errcode.InvalidInput, "disk image's chunks add up to %d bytes but its config declares %d", total, cfg.FileSize)
	}
	if cfg.BackingFile != "" && (filepath.IsAbs(cfg.BackingFile) || !filepath.IsLocal(cfg.BackingFile)) {
		return desc, m, cfg, errcode.New(errcode.InvalidInput, "disk image names backing file %q, which is not a path below the overlay's directory", cfg.BackingFile)
	}
	return desc, m, cfg, nil
}

// RestoreResult is what Restore wrote.
type RestoreResult struct {
	Manifest ocispec.Descriptor
	Config   DiskConfig
	Bytes    int64
	Duration time.Duration
}

// Restore writes the disk image in repo to path, before QEMU starts: every
// chunk is verified before it is written, the file appears at path only
// once complete and synced (an existing file there is replaced only then),
// its header must match the image's config, and its backing file must
// resolve beside it.
func Restore(ctx context.Context, repo ociimage.Repository, path string, opts chunk.StreamOptions) (*RestoreResult, error) {
	start := time.Now()
	desc, m, cfg, err := LoadDiskConfig(ctx, repo)
	if err != nil {
		return nil, err
	}
	// Check the backing file first: a restore that cannot boot is refused
	// before anything is written.
	if cfg.BackingFile != "" {
		if err := CheckBacking(path, Header{BackingFile: cfg.BackingFile, BackingFormat: cfg.BackingFormat}); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the overlay's directory")
	}
	// Guest data: readable by the owner and the group QEMU shares (fsGroup), no one else.
	out, err := atomicfile.Create(path, 0o660)
	if err != nil {
		return nil, errcode.Ensure(errcode.Internal, err, "creating %s", path)
	}
	defer out.Abort()
	head := &headWriter{max: 2 << 20} // the header lives in the first cluster, at most 2 MiB
	n, err := chunk.DecodeStream(ctx, m.Layers, repo, io.MultiWriter(out, head), opts)
	if err != nil {
		return nil, err
	}
	h, err := ReadHeader(bytes.NewReader(head.buf), n)
	if err != nil {
		return nil, err
	}
	if err := h.Validate(); err != nil {
		return nil, err
	}
	if h.VirtualSize != cfg.VirtualSize || h.BackingFile != cfg.BackingFile || h.BackingFormat != cfg.BackingFormat {
		return nil, errcode.New(errcode.InvalidInput, "the restored overlay's header (size %d, backing %q) does not match the image's config (size %d, backing %q)",
			h.VirtualSize, h.BackingFile, cfg.VirtualSize, cfg.BackingFile)
	}
	if err := out.Commit(); err != nil {
		return nil, err
	}
	return &RestoreResult{Manifest: desc, Config: cfg, Bytes: n, Duration: time.Since(start)}, nil
}

// headWriter keeps the first max bytes written to it.
type headWriter struct {
	buf []byte
	max int
}

func (h *headWriter) Write(p []byte) (int, error) {
	if room := h.max - len(h.buf); room > 0 {
		h.buf = append(h.buf, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

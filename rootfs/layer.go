package rootfs

import (
	"compress/gzip"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/diff"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	ctdrootfs "github.com/containerd/containerd/v2/pkg/rootfs"
	"github.com/containerd/errdefs"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/identity"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// The compressions a captured layer can have.
const (
	LayerZstd = "zstd"
	LayerGzip = "gzip"
)

// LayerOptions tunes CaptureLayer. The zero value is the default.
type LayerOptions struct {
	// Compression asks for LayerZstd (the default) or LayerGzip.
	// containerd's differ before 1.7 cannot write zstd: then the layer is
	// gzip, and LayerResult.Compression says so.
	Compression string
	// PauseTask freezes the container's task while its writable layer is
	// read (what `nerdctl commit` does by default), so that no process in
	// it changes a file half-way through the diff. Off by default: in a
	// checkpoint the VM is already stopped, and QEMU must keep answering
	// QMP.
	PauseTask bool
	// LeaseExpiry bounds how long containerd keeps the content this capture
	// creates if vmsnap dies before it ends its lease: 1 hour by default.
	LeaseExpiry time.Duration
	// CreatedBy is the history entry's created_by: "vmsnap checkpoint" by
	// default.
	CreatedBy string
	// Annotations are added to the new manifest's.
	Annotations map[string]string
	// Progress, if set, is called with the bytes of each blob stored.
	Progress func(n int64)
}

// LayerResult is the image CaptureLayer stored.
type LayerResult struct {
	Image    ociimage.Reference // pinned by digest
	Manifest ocispec.Descriptor
	Config   ocispec.Descriptor
	// Layer is the new layer: the diff of the container's writable layer.
	Layer       ocispec.Descriptor
	DiffID      digest.Digest // of the new layer, uncompressed
	Compression string        // LayerZstd or LayerGzip
	// ZstdRefused is containerd's answer when zstd was asked for and gzip
	// used instead ("" otherwise).
	ZstdRefused string

	ContainerID   string
	BaseImage     string        // the container's image name in containerd
	BaseDigest    digest.Digest // the base image's target (index or manifest)
	BaseLayers    int
	StoredBytes   int64 // manifest, config and every layer
	UploadedBytes int64 // the blobs the repository did not have yet
	Durations     LayerDurations
}

// LayerDurations are the phases of CaptureLayer.
type LayerDurations struct {
	Diff  time.Duration // containerd computing and storing the diff
	Push  time.Duration // blobs and manifest into the repository
	Total time.Duration
}

// CaptureLayer stores, in repo, the image a container of containerd runs
// from plus one layer holding the diff of its writable layer (its active
// snapshot against the image's top snapshot): what `nerdctl commit` makes.
//
// The diff is computed by containerd's diff service, on a fresh mount of
// the snapshot, so it holds what the container wrote to its own root
// filesystem and nothing of its volumes: bind mounts, tmpfs and the like
// live elsewhere. The mount points the runtime had to create in the
// writable layer are in it, empty (directories for volumes, empty files for
// file mounts such as CRI's /etc/hosts), as in any commit. Files the
// container deleted from its image are whiteouts (.wh.NAME) in the layer.
//
// Everything happens under a containerd lease: the diff and the base image's
// content cannot be garbage-collected while they are read, and the diff is
// dropped once the lease ends. Blobs go to repo first (layers of any size
// are streamed if repo is an ociimage.BlobStreamer), the manifest last.
//
// Errors: an unknown container is VM_NOT_FOUND; a container with no image or
// snapshot, or whose image or layers containerd no longer holds, is
// INVALID_INPUT; containerd failing is INTERNAL; the store's errors are its
// own (REGISTRY_ERROR, AUTH_FAILED, ...).
func CaptureLayer(ctx context.Context, client *containerd.Client, namespace, containerID string, repo ociimage.Repository, opts LayerOptions) (*LayerResult, error) {
	t0 := time.Now()
	if client == nil || containerID == "" || repo == nil {
		return nil, errcode.New(errcode.Usage, "capturing a container's writable layer needs a containerd client, a container ID and a repository")
	}
	switch opts.Compression {
	case "":
		opts.Compression = LayerZstd
	case LayerZstd, LayerGzip:
	default:
		return nil, errcode.New(errcode.Usage, "layer compression %q: use %s or %s", opts.Compression, LayerZstd, LayerGzip)
	}
	if opts.LeaseExpiry <= 0 {
		opts.LeaseExpiry = time.Hour
	}
	if opts.CreatedBy == "" {
		opts.CreatedBy = "vmsnap checkpoint"
	}
	if namespace != "" {
		ctx = namespaces.WithNamespace(ctx, namespace)
	}

	// The lease holds the diff this capture writes and the base image's
	// blobs it reads; its end (or its expiry, if we die) releases them.
	ctx, endLease, err := client.WithLease(ctx, leases.WithRandomID(), leases.WithExpiration(opts.LeaseExpiry),
		leases.WithLabel("dev.vmsnap.purpose", "rootfs capture of "+containerID))
	if err != nil {
		return nil, ctdErr(err, "creating a containerd lease")
	}
	defer endLease(context.WithoutCancel(ctx))

	cont, err := client.LoadContainer(ctx, containerID)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return nil, errcode.Wrap(errcode.VMNotFound, err, "container %s is not in containerd (namespace %s): it was deleted", containerID, namespace)
		}
		return nil, ctdErr(err, "loading container %s", containerID)
	}
	info, err := cont.Info(ctx)
	if err != nil {
		return nil, ctdErr(err, "reading container %s", containerID)
	}
	if info.Image == "" || info.SnapshotKey == "" || info.Snapshotter == "" {
		return nil, errcode.New(errcode.InvalidInput,
			"container %s has no image or no snapshot (image %q, snapshot %q): only a container created from an image has a writable layer to capture", containerID, info.Image, info.SnapshotKey)
	}
	img, err := client.GetImage(ctx, info.Image)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return nil, errcode.Wrap(errcode.InvalidInput, err, "the image %s of container %s is no longer in containerd: the new image needs its layers", info.Image, containerID)
		}
		return nil, ctdErr(err, "reading image %s", info.Image)
	}
	cs := client.ContentStore()
	base, err := images.Manifest(ctx, cs, img.Target(), img.Platform())
	if err != nil {
		return nil, ctdErr(err, "reading the manifest of image %s", info.Image)
	}
	if err := holdContent(ctx, client, append([]ocispec.Descriptor{img.Target(), base.Config}, base.Layers...)); err != nil {
		return nil, err
	}
	if base.Config.Size < 0 || base.Config.Size > ociimage.MaxConfigSize {
		return nil, errcode.New(errcode.InvalidInput, "the config of image %s is %d bytes, more than the %d vmsnap reads", info.Image, base.Config.Size, ociimage.MaxConfigSize)
	}
	configJSON, err := content.ReadBlob(ctx, cs, base.Config)
	if err != nil {
		return nil, ctdErr(err, "reading the config of image %s", info.Image)
	}
	var cfg map[string]json.RawMessage
	var rootFS ocispec.RootFS
	var history []ocispec.History
	if err := json.Unmarshal(configJSON, &cfg); err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "the config of image %s is not a JSON object", info.Image)
	}
	if err := json.Unmarshal(cfg["rootfs"], &rootFS); err != nil || rootFS.Type != "layers" {
		return nil, errcode.New(errcode.InvalidInput, "the config of image %s has no layers rootfs (%v)", info.Image, err)
	}
	if raw, ok := cfg["history"]; ok {
		if err := json.Unmarshal(raw, &history); err != nil {
			return nil, errcode.Wrap(errcode.InvalidInput, err, "the config of image %s has an unreadable history", info.Image)
		}
	}
	if len(rootFS.DiffIDs) != len(base.Layers) {
		return nil, errcode.New(errcode.InvalidInput, "image %s has %d layers but %d diff_ids", info.Image, len(base.Layers), len(rootFS.DiffIDs))
	}

	sn := client.SnapshotService(info.Snapshotter)
	sinfo, err := sn.Stat(ctx, info.SnapshotKey)
	if err != nil {
		return nil, ctdErr(err, "reading snapshot %s of container %s", info.SnapshotKey, containerID)
	}
	// The diff is taken against the snapshot's parent: it must be the
	// image's top layer, or the new layer would not apply on the image.
	if chain := identity.ChainID(rootFS.DiffIDs); len(rootFS.DiffIDs) > 0 && sinfo.Parent != chain.String() {
		return nil, errcode.New(errcode.InvalidInput,
			"the writable layer of container %s sits on snapshot %q, not on its image %s (%s): cannot express it as a layer of that image", containerID, sinfo.Parent, info.Image, chain)
	}

	if opts.PauseTask {
		resume, err := pauseTask(ctx, cont)
		if err != nil {
			return nil, err
		}
		defer resume()
	}

	tDiff := time.Now()
	res := &LayerResult{ContainerID: containerID, BaseImage: info.Image, BaseDigest: img.Target().Digest, BaseLayers: len(base.Layers)}
	layer, err := createDiff(ctx, client, sn, info.SnapshotKey, containerID, opts.Compression, res)
	if err != nil {
		return nil, err
	}
	diffID, err := uncompressedDigest(ctx, cs, layer)
	if err != nil {
		return nil, err
	}
	res.DiffID = diffID
	res.Durations.Diff = time.Since(tDiff)

	// The new config: the base's, every field kept, with the layer added.
	now := time.Now().UTC()
	rootFS.DiffIDs = append(rootFS.DiffIDs, diffID)
	if err := setJSON(cfg, "rootfs", rootFS); err != nil {
		return nil, err
	}
	if consistentHistory(history, len(base.Layers)) && len(history) > 0 {
		history = append(history, ocispec.History{Created: &now, CreatedBy: opts.CreatedBy, Comment: "writable layer of container " + containerID})
		if err := setJSON(cfg, "history", history); err != nil {
			return nil, err
		}
	}
	if err := setJSON(cfg, "created", now); err != nil {
		return nil, err
	}
	newConfig, err := json.Marshal(cfg)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "encoding the new image config")
	}
	configDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(newConfig), Size: int64(len(newConfig))}
	res.Layer = ocispec.Descriptor{MediaType: layer.MediaType, Digest: layer.Digest, Size: layer.Size}
	res.Config = configDesc

	m := ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    configDesc,
		Annotations: map[string]string{
			ociimage.AnnotationCreated:        now.Format(time.RFC3339),
			ocispec.AnnotationBaseImageName:   info.Image,
			ocispec.AnnotationBaseImageDigest: img.Target().Digest.String(),
		},
	}
	for k, v := range opts.Annotations {
		m.Annotations[k] = v
	}
	for _, l := range base.Layers {
		m.Layers = append(m.Layers, ocispec.Descriptor{MediaType: ociLayerType(l.MediaType), Digest: l.Digest, Size: l.Size, URLs: l.URLs})
	}
	m.Layers = append(m.Layers, res.Layer)

	// Push: layers (streamed from containerd's content store), config,
	// manifest last.
	tPush := time.Now()
	for i, l := range m.Layers {
		src := layer // the new one, last
		if i < len(base.Layers) {
			src = base.Layers[i]
		}
		res.StoredBytes += l.Size
		n, err := pushFromContent(ctx, cs, repo, l, src)
		if err != nil {
			return nil, err
		}
		res.UploadedBytes += n
		if opts.Progress != nil && n > 0 {
			opts.Progress(n)
		}
	}
	if err := repo.PutBlob(ctx, configDesc, newConfig); err != nil {
		return nil, err
	}
	res.UploadedBytes += configDesc.Size
	mdesc, err := repo.PutManifest(ctx, m)
	if err != nil {
		return nil, err
	}
	res.StoredBytes += configDesc.Size + mdesc.Size
	res.UploadedBytes += mdesc.Size
	res.Manifest = mdesc
	res.Image = repo.Reference().WithDigest(mdesc.Digest)
	res.Durations.Push = time.Since(tPush)
	res.Durations.Total = time.Since(t0)
	return res, nil
}

// createDiff asks containerd's diff service for the snapshot's diff in the
// compression asked for; zstd refused as not implemented (containerd 1.6)
// falls back to gzip.
func createDiff(ctx context.Context, client *containerd.Client, sn snapshots.Snapshotter, key, containerID, compression string, res *LayerResult) (ocispec.Descriptor, error) {
	mediaType := ocispec.MediaTypeImageLayerZstd
	if compression == LayerGzip {
		mediaType = ocispec.MediaTypeImageLayerGzip
	}
	ref := "vmsnap-rootfs-" + containerID + "-" + randomRef()
	desc, err := ctdrootfs.CreateDiff(ctx, key, sn, client.DiffService(), diff.WithMediaType(mediaType), diff.WithReference(ref))
	if err != nil && mediaType == ocispec.MediaTypeImageLayerZstd && (errdefs.IsNotImplemented(err) || strings.Contains(err.Error(), "not implemented")) {
		res.ZstdRefused = err.Error()
		mediaType, compression = ocispec.MediaTypeImageLayerGzip, LayerGzip
		desc, err = ctdrootfs.CreateDiff(ctx, key, sn, client.DiffService(), diff.WithMediaType(mediaType), diff.WithReference(ref+"-gzip"))
	}
	if err != nil {
		if errdefs.IsNotFound(err) {
			return desc, errcode.Wrap(errcode.VMNotFound, err, "the writable layer of container %s is gone (the container was deleted)", containerID)
		}
		return desc, ctdErr(err, "computing the diff of container %s's writable layer", containerID)
	}
	if desc.MediaType != mediaType {
		return desc, errcode.New(errcode.Internal, "containerd: asked for a %s diff, got %s", mediaType, desc.MediaType)
	}
	res.Compression = compression
	return desc, nil
}

// holdContent adds the blobs to the context's lease, so that an image
// deleted while we read it keeps its content until we are done.
func holdContent(ctx context.Context, client *containerd.Client, descs []ocispec.Descriptor) error {
	id, ok := leases.FromContext(ctx)
	if !ok {
		return nil
	}
	ls := client.LeasesService()
	for _, d := range descs {
		if err := ls.AddResource(ctx, leases.Lease{ID: id}, leases.Resource{ID: d.Digest.String(), Type: "content"}); err != nil {
			return ctdErr(err, "adding %s to the capture's lease", d.Digest)
		}
	}
	return nil
}

func pauseTask(ctx context.Context, cont containerd.Container) (resume func(), err error) {
	task, err := cont.Task(ctx, nil)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return func() {}, nil // no task: nothing writes
		}
		return nil, ctdErr(err, "finding the task of container %s", cont.ID())
	}
	if err := task.Pause(ctx); err != nil {
		return nil, ctdErr(err, "pausing container %s", cont.ID())
	}
	return func() { task.Resume(context.WithoutCancel(ctx)) }, nil
}

// uncompressedDigest is the layer's diff ID: the label containerd's differ
// puts on the content it wrote, else computed by decompressing it.
func uncompressedDigest(ctx context.Context, cs content.Store, desc ocispec.Descriptor) (digest.Digest, error) {
	info, err := cs.Info(ctx, desc.Digest)
	if err != nil {
		return "", ctdErr(err, "reading the new layer's content info")
	}
	if s, ok := info.Labels[labels.LabelUncompressed]; ok {
		if d, err := digest.Parse(s); err == nil {
			return d, nil
		}
	}
	ra, err := cs.ReaderAt(ctx, desc)
	if err != nil {
		return "", ctdErr(err, "opening the new layer")
	}
	defer ra.Close()
	r, err := decompressor(desc.MediaType, io.NewSectionReader(ra, 0, desc.Size))
	if err != nil {
		return "", err
	}
	defer r.Close()
	d := digest.SHA256.Digester()
	if _, err := io.Copy(d.Hash(), r); err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "decompressing the new layer")
	}
	return d.Digest(), nil
}

// decompressor reads a layer of media type mt uncompressed.
func decompressor(mt string, r io.Reader) (io.ReadCloser, error) {
	switch {
	case strings.HasSuffix(mt, "+zstd") || strings.HasSuffix(mt, ".zstd"):
		z, err := zstd.NewReader(r)
		if err != nil {
			return nil, errcode.Wrap(errcode.Internal, err, "zstd")
		}
		return z.IOReadCloser(), nil
	case strings.HasSuffix(mt, "+gzip") || strings.HasSuffix(mt, ".gzip"):
		g, err := gzip.NewReader(r)
		if err != nil {
			return nil, errcode.Wrap(errcode.InvalidInput, err, "layer is not gzip")
		}
		return g, nil
	case mt == ocispec.MediaTypeImageLayer || mt == images.MediaTypeDockerSchema2Layer:
		return io.NopCloser(r), nil
	}
	return nil, errcode.New(errcode.InvalidInput, "unknown layer media type %q", mt)
}

// pushFromContent stores a blob of containerd's content store (src) in repo
// as desc, unless repo has it. It returns the bytes uploaded.
func pushFromContent(ctx context.Context, cs content.Store, repo ociimage.Repository, desc, src ocispec.Descriptor) (int64, error) {
	has, err := repo.HasBlob(ctx, desc.Digest)
	if err != nil {
		return 0, err
	}
	if has {
		return 0, nil
	}
	ra, err := cs.ReaderAt(ctx, src)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return 0, errcode.Wrap(errcode.InvalidInput, err,
				"layer %s of the container's image is not in containerd's content store (discarded after unpacking?) nor in the target repository", desc.Digest)
		}
		return 0, ctdErr(err, "opening blob %s", desc.Digest)
	}
	defer ra.Close()
	if err := ociimage.PutBlobFrom(ctx, repo, desc, ra); err != nil {
		return 0, err
	}
	return desc.Size, nil
}

// ociLayerType maps Docker layer media types to their OCI equivalents (the
// bytes are the same format), so that the new manifest is all OCI.
func ociLayerType(mt string) string {
	switch mt {
	case images.MediaTypeDockerSchema2Layer:
		return ocispec.MediaTypeImageLayer
	case images.MediaTypeDockerSchema2LayerGzip:
		return ocispec.MediaTypeImageLayerGzip
	case images.MediaTypeDockerSchema2LayerZstd:
		return ocispec.MediaTypeImageLayerZstd
	case images.MediaTypeDockerSchema2LayerForeign:
		return ocispec.MediaTypeImageLayerNonDistributable //nolint:staticcheck // the OCI name of a foreign layer
	case images.MediaTypeDockerSchema2LayerForeignGzip:
		return ocispec.MediaTypeImageLayerNonDistributableGzip //nolint:staticcheck
	}
	return mt
}

// consistentHistory reports whether history has one non-empty entry per
// layer, so that one more entry describes the new layer.
func consistentHistory(history []ocispec.History, layers int) bool {
	n := 0
	for _, h := range history {
		if !h.EmptyLayer {
			n++
		}
	}
	return n == layers
}

func setJSON(m map[string]json.RawMessage, key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "encoding the config's %s", key)
	}
	m[key] = b
	return nil
}

// ctdErr wraps a containerd failure as INTERNAL.
func ctdErr(err error, format string, args ...any) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return errcode.Wrap(errcode.Internal, err, "containerd: "+format, args...)
}

func randomRef() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

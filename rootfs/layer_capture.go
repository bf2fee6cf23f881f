package rootfs

import (
	"context"
	"encoding/json"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/identity"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// setDefaults checks the options' compression and fills in the defaults the
// zero value stands for.
func (opts *LayerOptions) setDefaults() error {
	switch opts.Compression {
	case "":
		opts.Compression = LayerZstd
	case LayerZstd, LayerGzip:
	default:
		return errcode.New(errcode.Usage, "layer compression %q: use %s or %s", opts.Compression, LayerZstd, LayerGzip)
	}
	if opts.LeaseExpiry <= 0 {
		opts.LeaseExpiry = time.Hour
	}
	if opts.CreatedBy == "" {
		opts.CreatedBy = "vmsnap checkpoint"
	}
	return nil
}

// layerBase is the container and the image it runs from, as CaptureLayer
// read them before the diff: the diff, the new config, the new manifest and
// the push each use part of it.
type layerBase struct {
	containerID string
	cont        containerd.Container
	info        containers.Container
	img         containerd.Image
	cs          content.Store
	sn          snapshots.Snapshotter // the container's snapshotter
	manifest    ocispec.Manifest      // the base image's
	cfg         map[string]json.RawMessage
	rootFS      ocispec.RootFS
	history     []ocispec.History
}

// loadLayerBase reads the container, its image's manifest and config (held
// in the context's lease), and checks that the container's snapshot sits on
// the image's top layer.
func loadLayerBase(ctx context.Context, client *containerd.Client, namespace, containerID string) (*layerBase, error) {
	b := &layerBase{containerID: containerID, cs: client.ContentStore()}
	var err error
	b.cont, err = client.LoadContainer(ctx, containerID)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return nil, errcode.Wrap(errcode.VMNotFound, err, "container %s is not in containerd (namespace %s): it was deleted", containerID, namespace)
		}
		return nil, ctdErr(err, "loading container %s", containerID)
	}
	if b.info, err = b.cont.Info(ctx); err != nil {
		return nil, ctdErr(err, "reading container %s", containerID)
	}
	if b.info.Image == "" || b.info.SnapshotKey == "" || b.info.Snapshotter == "" {
		return nil, errcode.New(errcode.InvalidInput,
			"container %s has no image or no snapshot (image %q, snapshot %q): only a container created from an image has a writable layer to capture", containerID, b.info.Image, b.info.SnapshotKey)
	}
	b.sn = client.SnapshotService(b.info.Snapshotter)
	if err := b.loadImage(ctx, client); err != nil {
		return nil, err
	}
	if err := b.readConfig(ctx); err != nil {
		return nil, err
	}
	if err := b.checkParent(ctx); err != nil {
		return nil, err
	}
	return b, nil
}

// loadImage reads the container's image and its manifest, and adds their
// blobs to the context's lease.
func (b *layerBase) loadImage(ctx context.Context, client *containerd.Client) error {
	var err error
	b.img, err = client.GetImage(ctx, b.info.Image)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return errcode.Wrap(errcode.InvalidInput, err, "the image %s of container %s is no longer in containerd: the new image needs its layers", b.info.Image, b.containerID)
		}
		return ctdErr(err, "reading image %s", b.info.Image)
	}
	b.manifest, err = images.Manifest(ctx, b.cs, b.img.Target(), b.img.Platform())
	if err != nil {
		return ctdErr(err, "reading the manifest of image %s", b.info.Image)
	}
	return holdContent(ctx, client, append([]ocispec.Descriptor{b.img.Target(), b.manifest.Config}, b.manifest.Layers...))
}

// readConfig reads the base image's config, bounded, keeping every field for
// the new config, and checks that its diff_ids match the manifest's layers.
func (b *layerBase) readConfig(ctx context.Context) error {
	image := b.info.Image
	if b.manifest.Config.Size < 0 || b.manifest.Config.Size > ociimage.MaxConfigSize {
		return errcode.New(errcode.InvalidInput, "the config of image %s is %d bytes, more than the %d vmsnap reads", image, b.manifest.Config.Size, ociimage.MaxConfigSize)
	}
	configJSON, err := content.ReadBlob(ctx, b.cs, b.manifest.Config)
	if err != nil {
		return ctdErr(err, "reading the config of image %s", image)
	}
	if err := json.Unmarshal(configJSON, &b.cfg); err != nil {
		return errcode.Wrap(errcode.InvalidInput, err, "the config of image %s is not a JSON object", image)
	}
	if err := json.Unmarshal(b.cfg["rootfs"], &b.rootFS); err != nil || b.rootFS.Type != "layers" {
		return errcode.New(errcode.InvalidInput, "the config of image %s has no layers rootfs (%v)", image, err)
	}
	if raw, ok := b.cfg["history"]; ok {
		if err := json.Unmarshal(raw, &b.history); err != nil {
			return errcode.Wrap(errcode.InvalidInput, err, "the config of image %s has an unreadable history", image)
		}
	}
	if len(b.rootFS.DiffIDs) != len(b.manifest.Layers) {
		return errcode.New(errcode.InvalidInput, "image %s has %d layers but %d diff_ids", image, len(b.manifest.Layers), len(b.rootFS.DiffIDs))
	}
	return nil
}

// checkParent refuses a container whose snapshot does not sit on its image's
// top layer: the diff is taken against the snapshot's parent, so the new
// layer would not apply on the image.
func (b *layerBase) checkParent(ctx context.Context) error {
	sinfo, err := b.sn.Stat(ctx, b.info.SnapshotKey)
	if err != nil {
		return ctdErr(err, "reading snapshot %s of container %s", b.info.SnapshotKey, b.containerID)
	}
	if chain := identity.ChainID(b.rootFS.DiffIDs); len(b.rootFS.DiffIDs) > 0 && sinfo.Parent != chain.String() {
		return errcode.New(errcode.InvalidInput,
			"the writable layer of container %s sits on snapshot %q, not on its image %s (%s): cannot express it as a layer of that image", b.containerID, sinfo.Parent, b.info.Image, chain)
	}
	return nil
}

// takeDiff makes the new layer in containerd's content store, with the task
// frozen if asked while containerd reads the snapshot (not while vmsnap
// compresses the tar containerd stored), and records the phases' durations.
func (b *layerBase) takeDiff(ctx context.Context, client *containerd.Client, tmp *scratch, opts LayerOptions, res *LayerResult) (compressedLayer, error) {
	tDiff := time.Now()
	d := layerDiff{svc: diffService(client), sn: b.sn, key: b.info.SnapshotKey, containerID: b.containerID, tmp: tmp}
	resume := func() {}
	if opts.PauseTask {
		var err error
		if resume, err = pauseTask(ctx, b.cont); err != nil {
			return compressedLayer{}, err
		}
	}
	layer, tarDesc, err := d.make(ctx, opts.Compression, opts.Progress)
	resume()
	if err != nil {
		return compressedLayer{}, err
	}
	res.Durations.Diff = time.Since(tDiff)
	if tarDesc.Digest != "" {
		tCompress := time.Now()
		if layer, err = d.compress(ctx, tarDesc, opts.Compression, opts.Progress); err != nil {
			return compressedLayer{}, err
		}
		res.Durations.Compress = time.Since(tCompress)
	}
	return layer, nil
}

// newConfig is the base's config, every field kept, with the new layer
// added (and its history entry, where the history lists every layer).
func (b *layerBase) newConfig(diffID digest.Digest, createdBy string, now time.Time) ([]byte, error) {
	rootFS := b.rootFS
	rootFS.DiffIDs = append(rootFS.DiffIDs, diffID)
	if err := setJSON(b.cfg, "rootfs", rootFS); err != nil {
		return nil, err
	}
	if consistentHistory(b.history, len(b.manifest.Layers)) && len(b.history) > 0 {
		history := append(b.history, ocispec.History{Created: &now, CreatedBy: createdBy, Comment: "writable layer of container " + b.containerID})
		if err := setJSON(b.cfg, "history", history); err != nil {
			return nil, err
		}
	}
	if err := setJSON(b.cfg, "created", now); err != nil {
		return nil, err
	}
	newConfig, err := json.Marshal(b.cfg)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "encoding the new image config")
	}
	return newConfig, nil
}

// newManifest is the base image's layers (as OCI media types) plus the new
// one, under the new config, annotated with the base image.
func (b *layerBase) newManifest(config, layer ocispec.Descriptor, annotations map[string]string, now time.Time) ocispec.Manifest {
	m := ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    config,
		Annotations: map[string]string{
			ociimage.AnnotationCreated:        now.Format(time.RFC3339),
			ocispec.AnnotationBaseImageName:   b.info.Image,
			ocispec.AnnotationBaseImageDigest: b.img.Target().Digest.String(),
		},
	}
	for k, v := range annotations {
		m.Annotations[k] = v
	}
	for _, l := range b.manifest.Layers {
		m.Layers = append(m.Layers, ocispec.Descriptor{MediaType: ociLayerType(l.MediaType), Digest: l.Digest, Size: l.Size, URLs: l.URLs})
	}
	m.Layers = append(m.Layers, layer)
	return m
}

// push stores the image in repo: layers (streamed from containerd's content
// store), config, manifest last; it fills in res's sizes, manifest and
// image.
func (b *layerBase) push(ctx context.Context, repo ociimage.Repository, m ocispec.Manifest, newConfig []byte, res *LayerResult) error {
	tPush := time.Now()
	for i, l := range m.Layers {
		src := res.Layer // the new one, last, in containerd's content store
		if i < len(b.manifest.Layers) {
			src = b.manifest.Layers[i]
		}
		res.StoredBytes += l.Size
		n, err := pushFromContent(ctx, b.cs, repo, l, src)
		if err != nil {
			return err
		}
		res.UploadedBytes += n
	}
	if err := repo.PutBlob(ctx, res.Config, newConfig); err != nil {
		return err
	}
	res.UploadedBytes += res.Config.Size
	mdesc, err := repo.PutManifest(ctx, m)
	if err != nil {
		return err
	}
	res.StoredBytes += res.Config.Size + mdesc.Size
	res.UploadedBytes += mdesc.Size
	res.Manifest = mdesc
	res.Image = repo.Reference().WithDigest(mdesc.Digest)
	res.Durations.Push = time.Since(tPush)
	return nil
}

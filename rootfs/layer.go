// Package rootfs captures the writable layer of the container QEMU runs in,
// through containerd, as an image: the container's image plus one layer of
// its changes, with whiteouts for deleted files and without volumes, as
// nerdctl commit would. The diff is computed by containerd's diff service
// under a lease, so nothing in flight is garbage-collected; the layer is
// zstd on every containerd (1.6 hands over a plain tar, which this package
// compresses in one streaming pass that also computes the diffID).
//
// It is not for the VM's qcow2 overlay (package vmstate/disk: a file QEMU
// writes, handled without containerd), for volumes (they are not in the
// writable layer), or for building images from scratch.
package rootfs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"slices"
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
	// Compression asks for LayerZstd (the default) or LayerGzip. Both work
	// whatever containerd's version: where its differ cannot write zstd
	// (1.6), vmsnap compresses containerd's uncompressed diff itself.
	Compression string
	// PauseTask freezes the container's task while containerd reads its
	// writable layer (what `nerdctl commit` does by default), so that no
	// process in it changes a file half-way through the diff; the task runs
	// again as soon as containerd has stored the diff. Off by default: in a
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
	// Progress, if set, is called with the bytes of the new layer written
	// so far (compressed, into containerd's content store, from where it is
	// pushed), from one goroutine at a time, as they are written: increasing,
	// the last call with Layer.Size. The push to the repository that
	// follows is not counted.
	Progress func(layerBytes int64)
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
	Diff     time.Duration // containerd computing and storing the diff
	Compress time.Duration // vmsnap compressing containerd's tar diff: 0 if containerd's differ compressed
	Push     time.Duration // blobs and manifest into the repository
	Total    time.Duration
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
// The layer is zstd by default. containerd 1.7 and later write it in their
// differ. Where the differ refuses zstd (1.6), and for gzip (which the
// differ writes about half as fast), containerd writes the diff as an
// uncompressed tar into its content store, and vmsnap compresses it back
// into the content store, streaming, with the diff ID and the blob's digest
// computed in the same pass, then deletes the tar.
//
// Everything happens under a containerd lease: the diff and the base image's
// content cannot be garbage-collected while they are read, and what this
// capture wrote is deleted once pushed (or dropped when the lease ends or
// expires, if vmsnap dies first). Blobs go to repo first (layers of any
// size are streamed if repo is an ociimage.BlobStreamer), the manifest last.
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
	if err := opts.setDefaults(); err != nil {
		return nil, err
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

	b, err := loadLayerBase(ctx, client, namespace, containerID)
	if err != nil {
		return nil, err
	}
	res := &LayerResult{ContainerID: containerID, BaseImage: b.info.Image, BaseDigest: b.img.Target().Digest, BaseLayers: len(b.manifest.Layers), Compression: opts.Compression}
	// The capture's scratch content lives until the push has read it.
	tmp := &scratch{cs: b.cs, token: randomRef()}
	defer tmp.cleanup(ctx)
	layer, err := b.takeDiff(ctx, client, tmp, opts, res)
	if err != nil {
		return nil, err
	}
	res.DiffID = layer.DiffID

	now := time.Now().UTC()
	newConfig, err := b.newConfig(layer.DiffID, opts.CreatedBy, now)
	if err != nil {
		return nil, err
	}
	res.Config = ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(newConfig), Size: int64(len(newConfig))}
	res.Layer = ocispec.Descriptor{MediaType: layer.MediaType, Digest: layer.Digest, Size: layer.Size}
	m := b.newManifest(res.Config, res.Layer, opts.Annotations, now)
	if err := b.push(ctx, repo, m, newConfig, res); err != nil {
		return nil, err
	}
	res.Durations.Total = time.Since(t0)
	return res, nil
}

// diffService is the differ CaptureLayer asks; tests replace it.
var diffService = func(c *containerd.Client) diff.Comparer { return c.DiffService() }

// layerDiff makes the new layer in containerd's content store, from the
// container's snapshot, in one of two ways:
//
//   - zstd, where containerd's differ writes it (containerd 1.7 and later):
//     it walks the snapshot and compresses in one pass, with no tar stored;
//   - else (zstd on containerd 1.6, and gzip, which vmsnap writes about twice
//     as fast as containerd's differ does), the differ stores an uncompressed
//     tar, which vmsnap compresses.
type layerDiff struct {
	svc         diff.Comparer
	sn          snapshots.Snapshotter
	key         string
	containerID string
	tmp         *scratch
}

// make asks containerd's differ for the layer: compressed as asked if it can
// (zstd on containerd 1.7 and later), else as a tar (tarDesc) for compress.
func (d *layerDiff) make(ctx context.Context, compression string, progress func(int64)) (layer compressedLayer, tarDesc ocispec.Descriptor, err error) {
	if compression == LayerZstd {
		layer, ok, err := d.zstdDiff(ctx, progress)
		if err != nil || ok {
			return layer, ocispec.Descriptor{}, err
		}
	}
	tarDesc, err = d.diff(ctx, ocispec.MediaTypeImageLayer, "tar", nil)
	return compressedLayer{}, tarDesc, err
}

// diff asks containerd's differ for the diff of the snapshot as mediaType,
// stored in its content store under the context's lease and marked as tmp's
// (name tells the ingest's reference apart). progress, if set, is called
// with the bytes stored so far, as the differ writes them.
func (d *layerDiff) diff(ctx context.Context, mediaType, name string, progress func(int64)) (ocispec.Descriptor, error) {
	ref := "vmsnap-rootfs-" + d.containerID + "-" + d.tmp.token + "-" + name
	stop := pollIngest(ctx, d.tmp.cs, ref, progress)
	desc, err := ctdrootfs.CreateDiff(ctx, d.key, d.sn, d.svc, diff.WithMediaType(mediaType),
		diff.WithReference(ref), diff.WithLabels(d.tmp.labels()))
	last := stop()
	if err != nil {
		// The differ leaves an ingest it was given a reference for.
		d.tmp.cs.Abort(context.WithoutCancel(ctx), ref)
		if errdefs.IsNotFound(err) {
			return desc, errcode.Wrap(errcode.VMNotFound, err, "the writable layer of container %s is gone (the container was deleted)", d.containerID)
		}
		return desc, ctdErr(err, "computing the diff of container %s's writable layer", d.containerID)
	}
	d.tmp.add(desc.Digest)
	if desc.MediaType != mediaType {
		return desc, errcode.New(errcode.Internal, "containerd: asked for a %s diff, got %s", mediaType, desc.MediaType)
	}
	if progress != nil && desc.Size > last {
		progress(desc.Size)
	}
	return desc, nil
}

// zstdDiff asks containerd's differ for a zstd layer. ok is false, with no
// error, where the differ cannot write zstd (containerd 1.6).
func (d *layerDiff) zstdDiff(ctx context.Context, progress func(int64)) (_ compressedLayer, ok bool, err error) {
	desc, err := d.diff(ctx, ocispec.MediaTypeImageLayerZstd, "zstd-diff", progress)
	if err != nil {
		if errdefs.IsNotImplemented(err) || strings.Contains(err.Error(), "not implemented") {
			return compressedLayer{}, false, nil
		}
		return compressedLayer{}, false, err
	}
	diffID, err := d.diffID(ctx, desc)
	if err != nil {
		return compressedLayer{}, false, err
	}
	return compressedLayer{MediaType: desc.MediaType, Digest: desc.Digest, Size: desc.Size, DiffID: diffID}, true, nil
}

// diffID is the diff ID of the zstd layer containerd's differ wrote: the
// label it puts on the content, else (content it already had, with no such
// label) computed by decompressing the layer.
func (d *layerDiff) diffID(ctx context.Context, desc ocispec.Descriptor) (digest.Digest, error) {
	info, err := d.tmp.cs.Info(ctx, desc.Digest)
	if err != nil {
		return "", ctdErr(err, "reading the new layer's content info")
	}
	if id, err := digest.Parse(info.Labels[labels.LabelUncompressed]); err == nil {
		return id, nil
	}
	ra, err := d.tmp.cs.ReaderAt(ctx, desc)
	if err != nil {
		return "", ctdErr(err, "opening the new layer")
	}
	defer ra.Close()
	zr, err := zstd.NewReader(io.NewSectionReader(newReadAheadReaderAt(ra, desc.Size), 0, desc.Size))
	if err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "zstd")
	}
	defer zr.Close()
	h := digest.SHA256.Digester()
	if _, err := io.Copy(h.Hash(), zr); err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "decompressing the new layer")
	}
	return h.Digest(), nil
}

// compress compresses the tar diff into a new blob of containerd's content
// store (marked as tmp's), in one streaming pass that also checks the tar
// against its digest, and deletes the tar once done.
func (d *layerDiff) compress(ctx context.Context, tarDesc ocispec.Descriptor, compression string, progress func(int64)) (compressedLayer, error) {
	cs := d.tmp.cs
	ra, err := cs.ReaderAt(ctx, tarDesc)
	if err != nil {
		return compressedLayer{}, ctdErr(err, "opening the diff of container %s", d.containerID)
	}
	defer ra.Close()
	ref := "vmsnap-rootfs-" + d.containerID + "-" + d.tmp.token + "-" + compression
	cw, err := content.OpenWriter(ctx, cs, content.WithRef(ref), content.WithDescriptor(ocispec.Descriptor{MediaType: layerMediaType(compression)}))
	if err != nil {
		return compressedLayer{}, ctdErr(err, "storing the new layer of container %s", d.containerID)
	}
	committed := false
	defer func() {
		if !committed {
			cw.Close()
			cs.Abort(context.WithoutCancel(ctx), ref)
		}
	}()
	layer, err := compressLayer(ctx, cw, io.NewSectionReader(ra, 0, tarDesc.Size), compression, progress)
	if err != nil {
		return layer, err
	}
	if layer.DiffID != tarDesc.Digest || layer.RawSize != tarDesc.Size {
		return layer, errcode.New(errcode.Internal, "containerd: the diff of container %s read back as %d bytes of digest %s, not the %d bytes of %s it stored",
			d.containerID, layer.RawSize, layer.DiffID, tarDesc.Size, tarDesc.Digest)
	}
	lbls := d.tmp.labels()
	lbls[labels.LabelUncompressed] = layer.DiffID.String()
	err = cw.Commit(ctx, layer.Size, layer.Digest, content.WithLabels(lbls))
	committed = true
	if err != nil && !errdefs.IsAlreadyExists(err) {
		cs.Abort(context.WithoutCancel(ctx), ref)
		return layer, ctdErr(err, "storing the new layer of container %s", d.containerID)
	}
	d.tmp.add(layer.Digest)
	d.tmp.remove(ctx, tarDesc.Digest) // done with it: free its space now
	return layer, nil
}

// pollIngest calls progress, if set, with the bytes written so far into
// containerd's ingest ref, every ingestPoll until stop is called, and only
// when they grew. stop returns, once progress is no longer called, the last
// value it was called with.
func pollIngest(ctx context.Context, cs content.Store, ref string, progress func(int64)) (stop func() int64) {
	if progress == nil {
		return func() int64 { return 0 }
	}
	done := make(chan struct{})
	exited := make(chan struct{})
	var last int64
	go func() {
		defer close(exited)
		t := time.NewTicker(ingestPoll)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if st, err := cs.Status(ctx, ref); err == nil && st.Offset > last {
				last = st.Offset
				progress(last)
			}
		}
	}()
	return func() int64 {
		close(done)
		<-exited
		return last
	}
}

const ingestPoll = 250 * time.Millisecond

// scratch is the content a capture stores in containerd's content store for
// itself. Each blob it writes carries the label scratchLabel=token, which
// containerd sets only on content it creates: a blob that was already there
// (the same bytes, from another image) keeps its labels and is never
// deleted here.
type scratch struct {
	cs      content.Store
	token   string
	digests []digest.Digest
}

const scratchLabel = "dev.vmsnap.rootfs-capture"

func (s *scratch) labels() map[string]string { return map[string]string{scratchLabel: s.token} }

func (s *scratch) add(d digest.Digest) { s.digests = append(s.digests, d) }

// remove deletes d if this capture created it. A failure is left to the
// lease: its end lets containerd collect what nothing else references.
func (s *scratch) remove(ctx context.Context, d digest.Digest) {
	s.digests = slices.DeleteFunc(s.digests, func(x digest.Digest) bool { return x == d })
	ctx = context.WithoutCancel(ctx)
	if info, err := s.cs.Info(ctx, d); err == nil && info.Labels[scratchLabel] == s.token {
		s.cs.Delete(ctx, d)
	}
}

// cleanup removes what remains.
func (s *scratch) cleanup(ctx context.Context) {
	for len(s.digests) > 0 {
		s.remove(ctx, s.digests[0])
	}
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
	if err := ociimage.PutBlobFrom(ctx, repo, desc, newReadAheadReaderAt(ra, src.Size)); err != nil {
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
		//lint:ignore SA1019 the OCI name of a foreign layer, which an image may still hold
		return ocispec.MediaTypeImageLayerNonDistributable
	case images.MediaTypeDockerSchema2LayerForeignGzip:
		//lint:ignore SA1019 as above
		return ocispec.MediaTypeImageLayerNonDistributableGzip
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

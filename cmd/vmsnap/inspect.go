package main

import (
	"context"
	"fmt"
	"io"
	"sort"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/rootfs/overlay"
	"github.com/vmsnap/vmsnap/vmstate"
)

func newInspectCmd(out *globalOutput) *cobra.Command {
	var reg registryFlags
	c := &cobra.Command{
		Use:   "inspect REF",
		Short: "Show what a snapshot image holds, and the images of its checkpoint",
		Long: `Show a VM state or disk overlay image: its digest, the recorded VM (QEMU
version, machine, CPUs, memory, devices, disks), sizes and chunks.

For a VM state image, the images of its checkpoint are listed together, pinned
by digest: the VM state, the disk overlay (an image of its own, or "in the
rootfs image" at its path when it lived in the QEMU container's writable
layer) and the rootfs image (the container's image plus its writable layer),
followed by the linked disk image's details. For a disk image, the VM state
images that refer to it (their manifest's subject) in the same repository.

Nothing is restored; every byte read is verified against its digest. Registry
access works as for checkpoint (--registry-config, --ca-file,
--insecure-registry).`,
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			return coded(runInspect(c.Context(), out, args[0], reg.options()))
		},
	}
	reg.add(c)
	addOutputFlags(c, out, false)
	return c
}

type inspectDoc struct {
	Image        string              `json:"image"`
	Digest       string              `json:"digest"`
	ArtifactType string              `json:"artifactType"`
	Chunks       int                 `json:"chunks"`
	StoredBytes  int64               `json:"storedBytes"`
	Annotations  map[string]string   `json:"annotations,omitempty"`
	VMState      *vmstate.Config     `json:"vmstate,omitempty"`
	Disk         *overlay.DiskConfig `json:"disk,omitempty"`
	// Checkpoint lists, for a VM state image, the images of its checkpoint
	// together.
	Checkpoint *checkpointImagesDoc `json:"checkpoint,omitempty"`
	LinkedDisk *inspectDoc          `json:"linkedDisk,omitempty"`
	// LinkedRootfs is the QEMU container's writable layer, captured with
	// the VM (an ordinary container image).
	LinkedRootfs *rootfsLinkDoc `json:"linkedRootfs,omitempty"`
	// Referrers are the VM state images whose subject is this disk image.
	Referrers []referrerDoc `json:"referrers,omitempty"`
}

// checkpointImagesDoc is what one checkpoint stored, each image pinned.
type checkpointImagesDoc struct {
	VMState string `json:"vmstate"`
	Disk    string `json:"disk,omitempty"` // the disk overlay's own image
	// DiskInRootfs is where the disk overlay is in the rootfs image, when
	// it lived in the QEMU container's writable layer.
	DiskInRootfs *api.DiskInRootfs `json:"diskInRootfs,omitempty"`
	Rootfs       string            `json:"rootfs,omitempty"`
}

type rootfsLinkDoc struct {
	Image      string `json:"image"`
	Digest     string `json:"digest"`
	Layers     int    `json:"layers"`
	Bytes      int64  `json:"bytes"`
	BaseImage  string `json:"baseImage,omitempty"` // the container's image it was captured on
	Layer      string `json:"layer"`               // the captured writable layer (the last one)
	LayerBytes int64  `json:"layerBytes"`          // its size, compressed
}

type referrerDoc struct {
	Image        string            `json:"image"`
	Digest       string            `json:"digest"`
	ArtifactType string            `json:"artifactType"`
	Annotations  map[string]string `json:"annotations,omitempty"`
}

func runInspect(ctx context.Context, out *globalOutput, s string, opts []ociimage.Option) error {
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return err
	}
	doc, err := inspectRef(ctx, ref, true, opts)
	if err != nil {
		return err
	}
	report(out, doc, func(w io.Writer) { printInspect(w, doc, "") })
	return nil
}

// resolveManifest opens ref and returns its manifest, verified.
func resolveManifest(ctx context.Context, ref ociimage.Reference, opts []ociimage.Option) (ocispec.Descriptor, ocispec.Manifest, error) {
	repo, err := ociimage.Open(ctx, ref, opts...)
	if err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, err
	}
	desc, err := repo.Resolve(ctx)
	if err != nil {
		return desc, ocispec.Manifest{}, err
	}
	m, err := repo.Manifest(ctx, desc)
	return desc, m, err
}

func inspectRef(ctx context.Context, ref ociimage.Reference, follow bool, opts []ociimage.Option) (*inspectDoc, error) {
	desc, m, err := resolveManifest(ctx, ref, opts)
	if err != nil {
		return nil, err
	}
	doc := &inspectDoc{
		Image: ref.WithDigest(desc.Digest).String(), Digest: desc.Digest.String(),
		ArtifactType: m.ArtifactType, Chunks: len(m.Layers), Annotations: m.Annotations,
	}
	for _, l := range m.Layers {
		doc.StoredBytes += l.Size
	}
	pinned, err := ociimage.Open(ctx, ref.WithDigest(desc.Digest), opts...)
	if err != nil {
		return nil, err
	}
	switch m.ArtifactType {
	case ociimage.ArtifactTypeVMState:
		_, _, cfg, err := vmstate.LoadConfig(ctx, pinned)
		if err != nil {
			return nil, err
		}
		doc.VMState = &cfg
		if !follow {
			break
		}
		doc.Checkpoint = &checkpointImagesDoc{VMState: doc.Image}
		if link := m.Annotations[ociimage.AnnotationDiskImage]; link != "" {
			dref, err := ociimage.ParseReference(link)
			if err != nil {
				return nil, errcode.Wrap(errcode.InvalidInput, err, "the image's linked disk reference")
			}
			if doc.LinkedDisk, err = inspectRef(ctx, dref, false, opts); err != nil {
				return nil, errcode.Wrap(errcode.Of(err), err, "the linked disk image %s", link)
			}
			if doc.LinkedDisk.Disk == nil {
				return nil, errcode.New(errcode.InvalidInput, "the linked disk image %s is a %s image, not a disk image", link, doc.LinkedDisk.ArtifactType)
			}
			doc.Checkpoint.Disk = doc.LinkedDisk.Image
		}
		if link := m.Annotations[ociimage.AnnotationRootfsImage]; link != "" {
			if doc.LinkedRootfs, err = inspectRootfs(ctx, link, opts); err != nil {
				return nil, errcode.Wrap(errcode.Of(err), err, "the linked rootfs image %s", link)
			}
			doc.Checkpoint.Rootfs = doc.LinkedRootfs.Image
			if p := m.Annotations[ociimage.AnnotationDiskRootfsPath]; p != "" {
				doc.Checkpoint.DiskInRootfs = &api.DiskInRootfs{Image: doc.LinkedRootfs.Image, Digest: doc.LinkedRootfs.Digest, Path: p}
			}
		}
	case ociimage.ArtifactTypeDisk:
		_, _, cfg, err := overlay.LoadDiskConfig(ctx, pinned)
		if err != nil {
			return nil, err
		}
		doc.Disk = &cfg
		if follow {
			refs, err := pinned.Referrers(ctx, desc)
			if err != nil {
				return nil, err
			}
			for _, r := range refs {
				// Some registries report the config's media type as the
				// artifact type of a referrer.
				if r.ArtifactType == ociimage.ArtifactTypeVMState || r.ArtifactType == ociimage.MediaTypeVMStateConfig {
					doc.Referrers = append(doc.Referrers, referrerDoc{
						Image: ref.WithDigest(r.Digest).String(), Digest: r.Digest.String(),
						ArtifactType: ociimage.ArtifactTypeVMState, Annotations: r.Annotations,
					})
				}
			}
		}
	default:
		return nil, errcode.New(errcode.InvalidInput, "%s is not a vmsnap image (artifact type %q)", ref, m.ArtifactType)
	}
	return doc, nil
}

func printInspect(w io.Writer, d *inspectDoc, indent string) {
	if c := d.Checkpoint; c != nil {
		fmt.Fprintf(w, "%scheckpoint images:\n", indent)
		fmt.Fprintf(w, "%s  vmstate: %s\n", indent, c.VMState)
		if c.Disk != "" {
			fmt.Fprintf(w, "%s  disk:    %s\n", indent, c.Disk)
		}
		if r := c.DiskInRootfs; r != nil {
			what := "disk:    in"
			if c.Disk != "" {
				what = "         also in"
			}
			fmt.Fprintf(w, "%s  %s the rootfs image, at %s\n", indent, what, r.Path)
		}
		if r := d.LinkedRootfs; r != nil {
			base := ""
			if r.BaseImage != "" {
				base = " on " + r.BaseImage
			}
			fmt.Fprintf(w, "%s  rootfs:  %s\n%s           container image%s: %d layers, %s, its writable layer %s\n",
				indent, r.Image, indent, base, r.Layers, humanBytes(r.Bytes), humanBytes(r.LayerBytes))
		}
	}
	fmt.Fprintf(w, "%simage:   %s\n", indent, d.Image)
	fmt.Fprintf(w, "%schunks:  %d, %s stored\n", indent, d.Chunks, humanBytes(d.StoredBytes))
	if c := d.VMState; c != nil {
		r := c.Record
		fmt.Fprintf(w, "%skind:    VM state (mode %s, taken %s)\n", indent, c.Mode, c.Created.Format("2006-01-02 15:04:05Z"))
		fmt.Fprintf(w, "%sstream:  %s raw, %s\n", indent, humanBytes(c.RawBytes), c.Compression)
		fmt.Fprintf(w, "%sQEMU:    %s (%s), %s, machine %s\n", indent, r.QEMUVersion, r.QEMUPackage, r.Arch, r.Machine)
		fmt.Fprintf(w, "%sCPUs:    %d x %s\n", indent, r.CPUs, r.CPUModel)
		fmt.Fprintf(w, "%smemory:  %s\n", indent, humanBytes(r.MemoryBytes))
		fmt.Fprintf(w, "%sdevices: %d PCI functions (%s)\n", indent, len(r.Devices), r.DevicesHash)
		for _, b := range r.Blocks {
			fmt.Fprintf(w, "%sdisk:    %s %s %s\n", indent, b.Device, b.Format, humanBytes(b.VirtualSize))
		}
	}
	if c := d.Disk; c != nil {
		fmt.Fprintf(w, "%skind:    disk overlay (qcow2 v%d, %s virtual, taken %s)\n", indent, c.Version, humanBytes(int64(c.VirtualSize)), c.Created.Format("2006-01-02 15:04:05Z"))
		if c.BackingFile != "" {
			fmt.Fprintf(w, "%sbacking: %s (%s), relative to the overlay\n", indent, c.BackingFile, c.BackingFormat)
		}
	}
	keys := make([]string, 0, len(d.Annotations))
	for k := range d.Annotations {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "%s  %s=%s\n", indent, k, d.Annotations[k])
	}
	if d.LinkedDisk != nil {
		fmt.Fprintf(w, "%slinked disk image:\n", indent)
		printInspect(w, d.LinkedDisk, indent+"  ")
	}
	if len(d.Referrers) > 0 {
		fmt.Fprintf(w, "%sVM state images of this disk:\n", indent)
		for _, r := range d.Referrers {
			fmt.Fprintf(w, "%s  %s (mode %s, taken %s)\n", indent, r.Image, r.Annotations[ociimage.AnnotationMode], r.Annotations[ociimage.AnnotationCreated])
		}
	}
}

// inspectRootfs describes a captured container image by its manifest.
func inspectRootfs(ctx context.Context, link string, opts []ociimage.Option) (*rootfsLinkDoc, error) {
	ref, err := ociimage.ParseReference(link)
	if err != nil {
		return nil, err
	}
	desc, m, err := resolveManifest(ctx, ref, opts)
	if err != nil {
		return nil, err
	}
	if m.ArtifactType != "" || m.Config.MediaType != ocispec.MediaTypeImageConfig || len(m.Layers) == 0 {
		return nil, errcode.New(errcode.InvalidInput, "%s is not a container image (artifact type %q, config %q, %d layers)", ref, m.ArtifactType, m.Config.MediaType, len(m.Layers))
	}
	top := m.Layers[len(m.Layers)-1]
	d := &rootfsLinkDoc{
		Image: ref.WithDigest(desc.Digest).String(), Digest: desc.Digest.String(), Layers: len(m.Layers),
		BaseImage: m.Annotations[ocispec.AnnotationBaseImageName], Layer: top.Digest.String(), LayerBytes: top.Size,
	}
	for _, l := range m.Layers {
		d.Bytes += l.Size
	}
	return d, nil
}

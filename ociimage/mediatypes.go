package ociimage

// The one place that knows vmsnap's media types and annotation keys.
const (
	// ArtifactTypeVMState marks a manifest that holds a VM's migration stream.
	ArtifactTypeVMState = "application/vnd.vmsnap.vmstate.v1"
	// ArtifactTypeDisk marks a manifest that holds a VM's qcow2 disk overlay.
	ArtifactTypeDisk = "application/vnd.vmsnap.disk.v1"

	// MediaTypeVMStateConfig is the config of a vmstate manifest: the
	// compatibility record and the stream's facts (vmstate.Config).
	MediaTypeVMStateConfig = "application/vnd.vmsnap.vmstate.config.v1+json"
	// MediaTypeDiskConfig is the config of a disk manifest (disk.DiskConfig).
	MediaTypeDiskConfig = "application/vnd.vmsnap.disk.config.v1+json"
	// MediaTypeChunk is one zstd-compressed chunk of a byte stream; the
	// stream is the concatenation of the layers in manifest order.
	MediaTypeChunk = "application/vnd.vmsnap.chunk.v1.raw+zstd"
	// MediaTypeRAMRegion is one region of a VM's RAM file (the memory-file
	// format, package vmstate/ramfile): the region's offset, a bitmap of
	// the pages it holds and those pages, zstd-compressed. Region layers
	// apply in manifest order, a delta's after its parent's.
	MediaTypeRAMRegion = "application/vnd.vmsnap.ram.region.v1+zstd"
	// MediaTypeRAMPageMap is a piece of a RAM file's page map: a 64-bit
	// hash per page (0 for a zero page), zstd-compressed, from which the
	// next checkpoint finds the pages that changed.
	MediaTypeRAMPageMap = "application/vnd.vmsnap.ram.pagemap.v1+zstd"
	// MediaTypeRAMPack is a pack of RAM regions: region blobs, each its
	// own zstd frame, concatenated (a valid zstd stream). Which frame is
	// which region lies in the image's one MediaTypeRAMIndex layer.
	MediaTypeRAMPack = "application/vnd.vmsnap.ram.pack.v1+zstd"
	// MediaTypeRAMIndex is the index of a memory-file image's packs: for
	// every region of the RAM file, its frames in the chain's packs and
	// the hash of its final content (docs/image-format.md).
	MediaTypeRAMIndex = "application/vnd.vmsnap.ram.index.v1+zstd"

	// AnnotationRawSize on a chunk layer: its size after decompression.
	// Decompression refuses to produce more.
	AnnotationRawSize = "dev.vmsnap.chunk.raw-size"
	// AnnotationRawOffset on a chunk layer: where its bytes start in the stream.
	AnnotationRawOffset = "dev.vmsnap.chunk.raw-offset"
	// AnnotationRAMOffset on a RAM region layer: the region's offset in
	// the RAM file, a multiple of the region size.
	AnnotationRAMOffset = "dev.vmsnap.ram.offset"
	// AnnotationRAMFirstPage on a page map layer: the first page it covers.
	AnnotationRAMFirstPage = "dev.vmsnap.ram.first-page"

	// Manifest annotations for people.
	AnnotationMode        = "dev.vmsnap.mode"
	AnnotationQEMUVersion = "dev.vmsnap.qemu.version"
	AnnotationMachine     = "dev.vmsnap.qemu.machine"
	AnnotationMemory      = "dev.vmsnap.vm.memory"
	AnnotationRawBytes    = "dev.vmsnap.stream.raw-bytes"
	AnnotationDiskPath    = "dev.vmsnap.disk.path" // on a disk manifest: the overlay's path as QEMU's container saw it (never a host path)

	// AnnotationPrevious, on a checkpoint index (on the state manifest of a
	// checkpoint from before the index): the digest of what the checkpoint's
	// tag named before this checkpoint moved it, if it named anything. It
	// chains the checkpoints stored under one tag, newest first, so that
	// retention (vmsnap prune) finds those no tag names any more.
	AnnotationPrevious = "dev.vmsnap.previous"
	// AnnotationCreated, on a checkpoint index and a vmstate manifest: when
	// the checkpoint was taken (RFC 3339); retention orders checkpoints by it.
	AnnotationCreated     = "org.opencontainers.image.created"
	AnnotationRefName     = "org.opencontainers.image.ref.name"
	AnnotationTitle       = "org.opencontainers.image.title"
	AnnotationDescription = "org.opencontainers.image.description"
)

// Limits that keep a hostile or corrupt image from exhausting memory.
const (
	MaxManifestSize = 4 << 20   // bytes of one manifest
	MaxConfigSize   = 1 << 20   // bytes of one config blob
	MaxLayers       = 1 << 20   // layers of one manifest
	MaxChunkSize    = 64 << 20  // bytes of one chunk, compressed or raw
	MaxPackSize     = 256 << 20 // bytes of one RAM pack (MediaTypeRAMPack)
	MaxIndexSize    = 16 << 20  // bytes of a layout's index.json (tens of thousands of entries)
	MaxTags         = 100000    // tags of one repository that vmsnap lists (retention)

	// A cosign signature manifest (sha256-HEX.sig) and its payloads are
	// read before the image they sign is trusted: whoever can push to the
	// repository writes them. One layer per signature, so a few hundred
	// bytes each; cosign itself reads at most 1000.
	MaxSignatureManifestSize = 512 << 10
	MaxSignatureLayers       = 1000
	MaxSignaturePayloadSize  = 64 << 10 // a simple signing payload is about 250 bytes
	maxSignatureBytes        = 1 << 10  // a decoded signature: 512 for RSA-4096, about 140 for ECDSA P-521
)

// Signatures, as cosign stores them for key-based signing (cosign sign
// --key): a manifest tagged sha256-HEX.sig (SignatureTag) in the signed
// image's repository, with an OCI image config and one layer per
// signature; the layer is the simple signing payload (which names the
// signed manifest's digest) and carries the base64 signature of its bytes
// in an annotation.
const (
	MediaTypeSimpleSigning    = "application/vnd.dev.cosign.simplesigning.v1+json"
	AnnotationCosignSignature = "dev.cosignproject.cosign/signature"
)

// The checkpoint index (checkpoint.go): an OCI image index in the state's
// repository that lists the images of one checkpoint, and whose digest names
// the checkpoint. It has no artifactType and its entries none: Debian's
// skopeo (1.9) rewrites an index that has, and the copy would get another
// digest. These annotations say what it is instead.
const (
	// ArtifactTypeCheckpoint is the value of AnnotationCheckpoint on a
	// checkpoint index: what its artifactType would be.
	ArtifactTypeCheckpoint = "application/vnd.vmsnap.checkpoint.v1"
	// AnnotationCheckpoint marks an image index as a checkpoint index.
	AnnotationCheckpoint = "dev.vmsnap.checkpoint"
	// AnnotationPart, on each entry of a checkpoint index: which part of the
	// checkpoint the manifest is (PartVMState, PartDisk, PartRootfs).
	AnnotationPart = "dev.vmsnap.part"
	// AnnotationDiskLink and AnnotationRootfsLink, on a checkpoint index:
	// the disk or rootfs image when it is in another repository than the
	// index, as REPOSITORY@sha256:HEX: a repository of the registry the
	// index is read from (for a layout, a directory beside the index's
	// layout), never a host (link.go).
	AnnotationDiskLink   = "dev.vmsnap.disk.link"
	AnnotationRootfsLink = "dev.vmsnap.rootfs.link"
	// AnnotationDiskRootfsPath, on a checkpoint index (on the state manifest
	// of a checkpoint from before the index): the path of the disk overlay
	// inside the rootfs image, when the overlay lived in the QEMU
	// container's writable layer and so rides in that image.
	AnnotationDiskRootfsPath = "dev.vmsnap.disk.rootfs-path"

	// AnnotationDiskImage and AnnotationRootfsImage are how a state
	// manifest linked its disk and rootfs images before the checkpoint
	// index: REF@DIGEST with the registry's host, the state manifest's
	// subject being the disk manifest. vmsnap reads them (legacy.go),
	// resolving the repository against the registry the state is read
	// from; it no longer writes them.
	AnnotationDiskImage   = "dev.vmsnap.disk.image"
	AnnotationRootfsImage = "dev.vmsnap.rootfs.image"
)

// The parts of a checkpoint, as AnnotationPart names them.
const (
	PartVMState = "vmstate" // the VM state image, always there
	PartDisk    = "disk"    // the disk overlay image
	PartRootfs  = "rootfs"  // the QEMU container's image with its writable layer
)

// Parts are the parts of a checkpoint in the order its index lists them.
var Parts = []string{PartVMState, PartDisk, PartRootfs}

// MaxCheckpointParts bounds the entries of a checkpoint index a reader accepts.
const MaxCheckpointParts = 16

// configMediaType is the config media type a manifest of artifactType must
// carry, or "" for an artifact type vmsnap does not write.
func configMediaType(artifactType string) string {
	switch artifactType {
	case ArtifactTypeVMState:
		return MediaTypeVMStateConfig
	case ArtifactTypeDisk:
		return MediaTypeDiskConfig
	}
	return ""
}

// describeArtifact names an image's kind for people, in error messages.
func describeArtifact(artifactType, configMediaType string) string {
	switch {
	case artifactType == ArtifactTypeVMState:
		return "VM state image"
	case artifactType == ArtifactTypeDisk:
		return "disk image"
	case artifactType == "" && configMediaType == "application/vnd.oci.image.config.v1+json":
		return "container image"
	case artifactType == "":
		return "image without an artifact type"
	}
	return "image of type " + clip(artifactType)
}

// Encryption, as the OCI image encryption convention of containers/ocicrypt
// (containerd's imgcrypt, skopeo) has it: an encrypted layer's media type is
// the plaintext one plus this suffix, whatever that one is.
const (
	MediaTypeEncryptedSuffix = "+encrypted"
	// AnnotationEncKeysJWE on an encrypted layer: the layer's private
	// options (key, nonce, plaintext digest) wrapped with JWE for every
	// recipient, base64.
	AnnotationEncKeysJWE = "org.opencontainers.image.enc.keys.jwe"
	// AnnotationEncPubOpts on an encrypted layer: the cipher and its HMAC,
	// base64 JSON.
	AnnotationEncPubOpts = "org.opencontainers.image.enc.pubopts"
	// AnnotationEncPrefix: every annotation of the convention starts with it.
	AnnotationEncPrefix = "org.opencontainers.image.enc."
)

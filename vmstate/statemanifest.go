package vmstate

import (
	"context"
	"maps"
	"strconv"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// pushStateManifest stores the state manifest, then the checkpoint index
// that lists it with what link adds, and runs the Commit hook: the tail of
// a checkpoint, as Checkpoint does it.
func pushStateManifest(ctx context.Context, repo ociimage.Repository, opts CheckpointOptions, res *CheckpointResult, link Link) error {
	record := res.Config.Record
	created := res.Config.Created.Format(time.RFC3339)
	annotations := map[string]string{
		ociimage.AnnotationMode:        string(opts.Mode),
		ociimage.AnnotationQEMUVersion: record.QEMUVersion,
		ociimage.AnnotationMachine:     record.Machine,
		ociimage.AnnotationMemory:      strconv.FormatInt(record.MemoryBytes, 10),
		ociimage.AnnotationRawBytes:    strconv.FormatInt(res.Stream.RawBytes, 10),
		ociimage.AnnotationCreated:     created,
	}
	pushStart := time.Now()
	var err error
	res.Manifest, err = ociimage.PushArtifact(ctx, repo, ociimage.Artifact{
		ArtifactType:    ociimage.ArtifactTypeVMState,
		ConfigMediaType: ociimage.MediaTypeVMStateConfig,
		Config:          res.Config,
		Layers:          res.Stream.Layers,
		Annotations:     annotations,
	})
	if err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "storing the state manifest")
	}
	index := ociimage.CheckpointIndex{
		Parts:       map[string]ocispec.Descriptor{ociimage.PartVMState: res.Manifest},
		Links:       link.Links,
		Annotations: map[string]string{ociimage.AnnotationCreated: created},
	}
	maps.Copy(index.Parts, link.Parts)
	maps.Copy(index.Annotations, opts.Annotations)
	maps.Copy(index.Annotations, link.Annotations)
	if res.Checkpoint, err = ociimage.PutCheckpoint(ctx, repo, index); err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "storing the checkpoint index")
	}
	commit := opts.Commit
	if commit == nil {
		commit = tagCheckpoint(repo)
	}
	if err = commit(ctx, res.Checkpoint); err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "moving the checkpoint's tags")
	}
	res.Durations.Push = time.Since(pushStart)
	res.Image = repo.Reference().WithDigest(res.Manifest.Digest)
	res.CheckpointImage = repo.Reference().WithDigest(res.Checkpoint.Digest)
	return nil
}

// tagCheckpoint is the Commit of a checkpoint given none: it points the tag
// of the reference repo was opened from, if any, at the checkpoint index,
// which PutIndex stored by digest only.
func tagCheckpoint(repo ociimage.Repository) func(context.Context, ocispec.Descriptor) error {
	return func(ctx context.Context, checkpoint ocispec.Descriptor) error {
		if tag := repo.Reference().Tag; tag != "" {
			return ociimage.TagManifest(ctx, repo, checkpoint, tag)
		}
		return nil
	}
}

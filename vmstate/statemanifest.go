package vmstate

import (
	"context"
	"strconv"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// pushStateManifest stores the state manifest with its annotations (the
// Checkpoint's and the link's) and runs the Commit hook: the tail of a
// checkpoint, as Checkpoint does it.
func pushStateManifest(ctx context.Context, repo ociimage.Repository, opts CheckpointOptions, res *CheckpointResult, link Link) error {
	record := res.Config.Record
	annotations := map[string]string{
		ociimage.AnnotationMode:        string(opts.Mode),
		ociimage.AnnotationQEMUVersion: record.QEMUVersion,
		ociimage.AnnotationMachine:     record.Machine,
		ociimage.AnnotationMemory:      strconv.FormatInt(record.MemoryBytes, 10),
		ociimage.AnnotationRawBytes:    strconv.FormatInt(res.Stream.RawBytes, 10),
		ociimage.AnnotationCreated:     res.Config.Created.Format(time.RFC3339),
	}
	for k, v := range opts.Annotations {
		annotations[k] = v
	}
	for k, v := range link.Annotations {
		annotations[k] = v
	}
	pushStart := time.Now()
	var err error
	res.Manifest, err = ociimage.PushArtifact(ctx, repo, ociimage.Artifact{
		ArtifactType:    ociimage.ArtifactTypeVMState,
		ConfigMediaType: ociimage.MediaTypeVMStateConfig,
		Config:          res.Config,
		Layers:          res.Stream.Layers,
		Annotations:     annotations,
		Subject:         link.Subject,
	})
	if err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "storing the state manifest")
	}
	commit := opts.Commit
	if commit == nil {
		commit = tagState(repo)
	}
	if err = commit(ctx, res.Manifest); err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "moving the checkpoint's tags")
	}
	res.Durations.Push = time.Since(pushStart)
	res.Image = repo.Reference().WithDigest(res.Manifest.Digest)
	return nil
}

// tagState is the Commit of a checkpoint given none: it points the tag of
// the reference repo was opened from, if any, at the state manifest, which
// PutManifest stored by digest only.
func tagState(repo ociimage.Repository) func(context.Context, ocispec.Descriptor) error {
	return func(ctx context.Context, state ocispec.Descriptor) error {
		if tag := repo.Reference().Tag; tag != "" {
			return ociimage.TagManifest(ctx, repo, state, tag)
		}
		return nil
	}
}

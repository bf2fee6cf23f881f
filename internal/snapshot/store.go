package snapshot

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// openStore parses a reference to write to, opens it and checks that we may
// write there, so that credentials or a CA problem surface before a VM is
// stopped. The repository is opened from the reference as given: every
// manifest of a checkpoint is stored by digest (PutManifest never tags), and
// the reference's tag moves only once all of them are stored (moveTags).
func openStore(ctx context.Context, s string, opts []ociimage.Option) (*store, error) {
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return nil, err
	}
	if ref.IsDigest() {
		return nil, errcode.New(errcode.InvalidInput,
			"cannot store a checkpoint at %s: a digest reference names an existing manifest; give REF or REF:TAG", s)
	}
	repo, err := ociimage.Open(ctx, ref, opts...)
	if err != nil {
		return nil, err
	}
	if err := ociimage.CheckAccess(ctx, repo); err != nil {
		return nil, err
	}
	return &store{repo}, nil
}

// store is where one image of a checkpoint goes: the repository opened from
// the reference the checkpoint was given, tag included.
type store struct {
	repo ociimage.Repository
}

// tag is the tag to move once everything is stored ("" for none).
func (st *store) tag() string { return st.repo.Reference().Tag }

// commit points the store's tag at desc.
func (st *store) commit(ctx context.Context, desc ocispec.Descriptor) error {
	if err := ociimage.TagManifest(ctx, st.repo, desc, st.tag()); err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "tagging %s as %s", st.repo.Reference().WithDigest(desc.Digest), st.tag())
	}
	return nil
}

// current resolves the manifest the store's tag names now.
func (st *store) current(ctx context.Context) (ocispec.Descriptor, error) {
	return st.repo.ResolveTag(ctx, st.tag())
}

// tagMove is one tag of a checkpoint to move: its store's tag to the
// manifest to. what names the image in errors.
type tagMove struct {
	what string // "disk", "rootfs" or "VM state"
	st   *store
	to   ocispec.Descriptor

	prev    ocispec.Descriptor // where the tag pointed before, if prevErr is nil
	prevErr error
}

// rollbackTimeout bounds moving tags back after a failure, which may be the
// caller's deadline.
const rollbackTimeout = 30 * time.Second

// moveTags moves the tags of one checkpoint's images in order, the VM
// state's last: it is the checkpoint's commit point. Moves without a store
// or a tag are skipped. Before any tag moves it resolves where the others
// point now, so that when a later move fails it can move those already
// moved back. That is best effort: a tag that named nothing before (or
// whose target could not be resolved, or that cannot be moved back) stays on
// its new manifest, as ociimage cannot delete a tag. The error keeps the
// failed move's code and lists, as details, what was moved back and what
// was not.
func moveTags(ctx context.Context, moves ...tagMove) error {
	moves = slices.DeleteFunc(moves, func(m tagMove) bool { return m.st == nil || m.st.tag() == "" })
	for i := range moves[:max(len(moves)-1, 0)] {
		moves[i].prev, moves[i].prevErr = moves[i].st.current(ctx)
	}
	for i, m := range moves {
		// Safely: a panic half-way must still move back what had moved.
		if err := errcode.Safely(func() error { return m.st.commit(ctx, m.to) }); err != nil {
			return rollbackTags(ctx, moves[:i], m, err)
		}
	}
	return nil
}

// rollbackTags, once the move failed has failed with err, moves back the
// tags moved before it, the last first, and returns err with what it did.
func rollbackTags(ctx context.Context, moved []tagMove, failed tagMove, err error) error {
	if len(moved) == 0 {
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	var details []string
	for _, m := range slices.Backward(moved) {
		name := fmt.Sprintf("the %s tag %s", m.what, m.st.repo.Reference())
		if m.prevErr != nil {
			details = append(details, fmt.Sprintf("%s is left on the new manifest %s: it named no manifest before, or none that could be resolved (%v), and vmsnap cannot delete a tag", name, m.to.Digest, m.prevErr))
			continue
		}
		if rerr := m.st.commit(ctx, m.prev); rerr != nil {
			details = append(details, fmt.Sprintf("%s is left on the new manifest %s: moving it back to %s failed (%v)", name, m.to.Digest, m.prev.Digest, rerr))
			continue
		}
		details = append(details, fmt.Sprintf("%s was moved back to %s", name, m.prev.Digest))
	}
	return &errcode.Error{Code: errcode.Of(err), Err: err, Details: details,
		Msg: fmt.Sprintf("the checkpoint is not committed: its images are stored by digest, but the %s tag did not move", failed.what)}
}

// openPinned opens the part of a checkpoint a restore needs (vmstate or
// disk), pinned to its manifest: s names the checkpoint (its index) or the
// part's own manifest, by digest only, unless allowTag. The checkpoint is
// returned too, nil when s named the manifest. With verification keys
// among opts (ociimage.WithVerifyKeys), what s names is verified first,
// before anything else is read; the index's parts are pinned by digest by
// what was verified.
func openPinned(ctx context.Context, s, what, part string, allowTag bool, opts []ociimage.Option) (ociimage.Repository, *ociimage.Checkpoint, error) {
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return nil, nil, err
	}
	if !ref.IsDigest() && !allowTag {
		return nil, nil, errcode.New(errcode.TagNotAllowed,
			"%s %s names a tag, which can move: give the digest that checkpoint printed (REF@sha256:...), or allow tags explicitly (%s)", what, s, errcode.Field("allowTag"))
	}
	return ociimage.OpenPart(ctx, ref, part, opts...)
}

// previousLink is the annotation that links a new checkpoint to the one
// its tag names now (AnnotationPrevious), or nil when the tag names none.
// It is read before the VM is touched; a checkpoint of another VM that
// moves the same tag meanwhile is not in the chain (tags are per VM).
func (st *store) previousLink(ctx context.Context) (map[string]string, error) {
	if st.tag() == "" {
		return nil, nil
	}
	desc, err := st.current(ctx)
	if errors.Is(err, ociimage.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, errcode.Ensure(errcode.RegistryError, err, "reading where the tag %s points before the checkpoint", st.repo.Reference())
	}
	if desc.MediaType != ocispec.MediaTypeImageIndex && desc.MediaType != ocispec.MediaTypeImageManifest {
		return nil, nil
	}
	return map[string]string{ociimage.AnnotationPrevious: desc.Digest.String()}, nil
}

// parent resolves a memory-file checkpoint's parent, REF@sha256:..., which
// must be in the state's own repository: the new manifest lists the
// parent's layers, which a store holds only in the repository they were
// stored in.
func (st *store) parent(ctx context.Context, s string, opts []ociimage.Option) (*ocispec.Descriptor, error) {
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return nil, err
	}
	if !ref.IsDigest() {
		return nil, errcode.New(errcode.Usage, "the parent %s names a tag: give the digest checkpoint printed (REF@sha256:...)", s)
	}
	if ref.WithDigest("").WithTag("") != st.repo.Reference().WithDigest("").WithTag("") {
		return nil, errcode.New(errcode.Usage, "the parent %s is in another repository than the checkpoint (%s): a delta lists its parent's layers, which must be in its own repository", s, st.repo.Reference().WithTag(""))
	}
	repo, err := ociimage.Open(ctx, ref, opts...)
	if err != nil {
		return nil, err
	}
	desc, err := repo.Resolve(ctx)
	if err != nil {
		return nil, err
	}
	// A checkpoint's digest names its index: the parent is its state.
	if desc, err = ociimage.StateManifest(ctx, repo, desc); err != nil {
		return nil, err
	}
	return &desc, nil
}

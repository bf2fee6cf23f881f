package snapshot

import (
	"context"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate"
)

// part is one image a checkpoint stores beside the VM state (the disk
// overlay, the container's writable layer). It is captured while the VM is
// stopped, is listed in the checkpoint index (or linked from it, in another
// repository) and has its own tag, which moves before the checkpoint's.
type part struct {
	what    string // "disk" or "rootfs", for errors
	st      *store
	capture func(ctx context.Context, link *vmstate.Link) (ocispec.Descriptor, error)
	stored  *ocispec.Descriptor // the manifest captured, stored by digest
}

// captureParts is a checkpoint's WhileStopped hook: it captures the parts
// in order and returns what they add to the checkpoint index together.
func captureParts(parts []*part) func(context.Context) (vmstate.Link, error) {
	return func(ctx context.Context) (vmstate.Link, error) {
		link := vmstate.Link{Parts: map[string]ocispec.Descriptor{}, Links: map[string]string{}, Annotations: map[string]string{}}
		for _, p := range parts {
			desc, err := p.capture(ctx, &link)
			if err != nil {
				return vmstate.Link{}, err
			}
			p.stored = &desc
		}
		return link, nil
	}
}

// commitParts is a checkpoint's Commit hook, once every image and the
// checkpoint index are stored by digest: it moves the tags of the parts
// captured, then the checkpoint's (to its index), the checkpoint's commit
// point (moveTags).
func commitParts(parts []*part, state *store) func(context.Context, ocispec.Descriptor) error {
	return func(ctx context.Context, checkpoint ocispec.Descriptor) error {
		var moves []tagMove
		for _, p := range parts {
			if p.stored != nil {
				moves = append(moves, tagMove{what: p.what, st: p.st, to: *p.stored})
			}
		}
		return moveTags(ctx, append(moves, tagMove{what: "checkpoint", st: state, to: checkpoint})...)
	}
}

// canHold refuses, before the VM is touched, an image store other for the
// part what that the checkpoint index in st could neither list (the same
// repository) nor link so that the link survives a copy
// (ociimage.RelativeLink), and one in the same repository under the
// checkpoint's own tag (it would move to the index). Nil passes.
func (st *store) canHold(what string, other *store) error {
	if other == nil {
		return nil
	}
	from, to := st.repo.Reference(), other.repo.Reference()
	if !ociimage.SameRepository(from, to) {
		// Any digest: whether the repository can be linked is the question.
		_, err := ociimage.RelativeLink(from, to.WithDigest(digest.FromString("")))
		return err
	}
	if to.Tag != "" && to.Tag == from.Tag {
		return errcode.New(errcode.Usage, "the %s image %s would have the checkpoint's own tag in its repository: give it a tag of its own, or none", what, to)
	}
	return nil
}

// join adds the manifest desc, stored in other as the checkpoint's part
// name, to the checkpoint index in st: listed if other is st's repository,
// linked otherwise.
func (st *store) join(link *vmstate.Link, name string, other *store, desc ocispec.Descriptor) error {
	from, to := st.repo.Reference(), other.repo.Reference()
	if ociimage.SameRepository(from, to) {
		link.Parts[name] = desc
		return nil
	}
	l, err := ociimage.RelativeLink(from, to.WithDigest(desc.Digest))
	link.Links[name] = l
	return err
}

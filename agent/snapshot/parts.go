package snapshot

import (
	"context"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/vmstate"
)

// part is one image a checkpoint stores beside the VM state (the disk
// overlay, the container's writable layer). It is captured while the VM is
// stopped, contributes its link (annotations on the state manifest, and its
// subject) and its tag, which moves before the state's.
type part struct {
	what    string // "disk" or "rootfs", for errors
	st      *store
	capture func(ctx context.Context, link *vmstate.Link) (ocispec.Descriptor, error)
	stored  *ocispec.Descriptor // the manifest captured, stored by digest
}

// captureParts is a checkpoint's WhileStopped hook: it captures the parts
// in order and returns their links together.
func captureParts(parts []*part) func(context.Context) (vmstate.Link, error) {
	return func(ctx context.Context) (vmstate.Link, error) {
		link := vmstate.Link{Annotations: map[string]string{}}
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

// commitParts is a checkpoint's Commit hook, once every image is stored by
// digest: it moves the tags of the parts captured, then the state's, the
// checkpoint's commit point (moveTags).
func commitParts(parts []*part, state *store) func(context.Context, ocispec.Descriptor) error {
	return func(ctx context.Context, desc ocispec.Descriptor) error {
		var moves []tagMove
		for _, p := range parts {
			if p.stored != nil {
				moves = append(moves, tagMove{what: p.what, st: p.st, to: *p.stored})
			}
		}
		return moveTags(ctx, append(moves, tagMove{what: "VM state", st: state, to: desc})...)
	}
}

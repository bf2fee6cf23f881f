package snapshot

import (
	"cmp"
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// Retention: a repository keeps its N newest checkpoints.
//
// A checkpoint is a checkpoint index (or, from before indexes, a VM state
// manifest). Prune finds those the repository's tags name, and from each
// follows its dev.vmsnap.previous annotation (what its tag named before the
// checkpoint moved it) to the checkpoints no tag names any more. It orders
// them newest first by their org.opencontainers.image.created annotation,
// keeps N and deletes the rest, each with its tags, the images it lists
// that nothing kept needs (in the same repository: VM state, disk,
// rootfs), and the referrers fallback tags (sha256-HEX) and cosign
// signatures (sha256-HEX.sig) of what it deleted. A layout then removes
// the blobs no remaining manifest needs; a registry does that in its own
// garbage collection.

// PruneSpec is one prune of a repository.
type PruneSpec struct {
	Repo   string // oci:DIR or HOST[:PORT]/REPO, without tag or digest
	Keep   int    // the newest checkpoints to keep, at least 1
	DryRun bool   // find and report, delete nothing
	Store  []ociimage.Option
}

// maxCheckpoints bounds how many checkpoints one prune reads.
const maxCheckpoints = ociimage.MaxTags

// pruneStep, when set (by tests), runs before each deletion with what it
// deletes; an error stops the prune there, as if it had been interrupted.
var pruneStep func(what string) error

// pruneRepo is what Prune needs of a store.
type pruneRepo interface {
	ociimage.Repository
	ociimage.TagLister
	ociimage.DigestResolver
	ociimage.ManifestDeleter
}

// Prune keeps the s.Keep newest checkpoints of a repository and deletes the
// older ones (see above). Deletions run oldest checkpoint first, each
// one's images before its state manifest, so an interrupted prune leaves
// every checkpoint it did not reach, kept or not, whole and findable, and
// running it again finishes the job.
func Prune(ctx context.Context, s PruneSpec) (*api.PruneResult, error) {
	start := time.Now()
	ref, err := ociimage.ParseReference(s.Repo)
	if err != nil {
		return nil, err
	}
	if ref.Tag != "" || ref.IsDigest() {
		return nil, errcode.New(errcode.Usage, "prune works on a whole repository: give %s without a tag or digest", ref.WithDigest(""))
	}
	if s.Keep < 1 {
		return nil, errcode.New(errcode.Usage, "%s %d: keep at least 1 checkpoint", errcode.Field("keep"), s.Keep)
	}
	r, err := ociimage.Open(ctx, ref, s.Store...)
	if err != nil {
		return nil, err
	}
	// Retention works on the stored manifests, encrypted or not.
	r = ociimage.Underlying(r)
	repo, ok := r.(pruneRepo)
	if !ok {
		return nil, errcode.New(errcode.Internal, "cannot prune a %T", r)
	}
	if err := ociimage.CheckAccess(ctx, repo); err != nil {
		return nil, err
	}
	inv, err := findCheckpoints(ctx, repo)
	if err != nil {
		return nil, err
	}
	p := planPrune(inv, s.Keep)
	if err := p.checkKinds(ctx, repo); err != nil {
		return nil, err
	}
	res := p.result(inv, ref.String(), s)
	if s.DryRun {
		return res, nil
	}
	if err := p.run(ctx, repo); err != nil {
		return nil, errcode.Ensure(errcode.RegistryError, err, "pruning %s", ref)
	}
	if gc, ok := r.(ociimage.GarbageCollector); ok {
		if err := step("the blobs no manifest needs"); err != nil {
			return nil, err
		}
		removed, err := gc.CollectGarbage(ctx, start, p.roots)
		if err != nil {
			return nil, err
		}
		res.RemovedBlobs = len(removed)
	}
	return res, nil
}

func step(what string) error {
	if pruneStep != nil {
		return pruneStep(what)
	}
	return nil
}

// checkpoint is one checkpoint prune found: an index, or a legacy VM
// state manifest.
type checkpoint struct {
	digest   digest.Digest
	created  time.Time
	dated    bool
	previous digest.Digest
	images   []ociimage.Part // its images but the manifest at digest, pinned: what prune may delete with it
	subject  digest.Digest   // kept with it, never deleted through it (legacy)
	older    int             // checkpoints found behind it through previous links
}

// inventory is what a repository holds, as far as prune is concerned.
type inventory struct {
	repo        ociimage.Reference
	tags        map[digest.Digest][]string // every tag, by what it names
	tagged      map[string]digest.Digest
	checkpoints map[digest.Digest]*checkpoint
	// unreadable are the checkpoints prune could not read: left alone and
	// reported, so that one bad index (anyone who may push to the
	// repository can write one) does not stop the retention of the rest.
	unreadable map[digest.Digest]string // why, by digest
}

// findCheckpoints reads the manifests the tags name, and follows the
// previous links of the checkpoints among them.
func findCheckpoints(ctx context.Context, repo pruneRepo) (*inventory, error) {
	inv := &inventory{repo: repo.Reference(), tags: map[digest.Digest][]string{}, tagged: map[string]digest.Digest{},
		checkpoints: map[digest.Digest]*checkpoint{}, unreadable: map[digest.Digest]string{}}
	tags, err := repo.ListTags(ctx)
	if err != nil {
		return nil, err
	}
	var todo []ocispec.Descriptor
	for _, t := range tags {
		d := t.Descriptor.Digest
		inv.tags[d] = append(inv.tags[d], t.Tag)
		inv.tagged[t.Tag] = d
		if len(inv.tags[d]) == 1 {
			todo = append(todo, t.Descriptor)
		}
	}
	for len(todo) > 0 {
		desc := todo[0]
		todo = todo[1:]
		if _, seen := inv.checkpoints[desc.Digest]; seen || !slices.Contains([]string{ocispec.MediaTypeImageIndex, ocispec.MediaTypeImageManifest, ""}, desc.MediaType) {
			continue
		}
		c, err := ociimage.ReadCheckpoint(ctx, repo, desc)
		if errors.Is(err, ociimage.ErrNotCheckpoint) {
			continue
		}
		if code := errcode.Of(err); code == errcode.InvalidInput || code == errcode.DigestMismatch {
			inv.unreadable[desc.Digest] = err.Error()
			continue
		}
		if err != nil {
			return nil, err
		}
		if len(inv.checkpoints) >= maxCheckpoints {
			return nil, errcode.New(errcode.InvalidInput, "%s holds more than %d checkpoints, more than one prune reads", inv.repo, maxCheckpoints)
		}
		cp := inv.parse(desc.Digest, c)
		inv.checkpoints[desc.Digest] = cp
		if cp.previous == "" {
			continue
		}
		if _, seen := inv.checkpoints[cp.previous]; seen {
			continue
		}
		prev, err := repo.ResolveDigest(ctx, cp.previous)
		if errors.Is(err, ociimage.ErrNotFound) {
			continue // deleted already: the chain ends here
		}
		if err != nil {
			return nil, err
		}
		todo = append(todo, prev)
	}
	for _, cp := range inv.checkpoints {
		cp.older = inv.countOlder(cp)
	}
	return inv, nil
}

// parse reads what prune needs from a checkpoint: its annotations and its
// parts (ReadCheckpoint leaves out legacy links that do not resolve: they
// name nothing prune could delete).
func (inv *inventory) parse(d digest.Digest, c *ociimage.Checkpoint) *checkpoint {
	cp := &checkpoint{digest: d, subject: c.Subject}
	a := c.Annotations
	if t, err := time.Parse(time.RFC3339, a[ociimage.AnnotationCreated]); err == nil {
		cp.created, cp.dated = t, true
	}
	if p, err := digest.Parse(a[ociimage.AnnotationPrevious]); err == nil && p != d {
		cp.previous = p
	}
	for _, p := range c.Parts {
		if p.Ref.Digest != d {
			cp.images = append(cp.images, p)
		}
	}
	return cp
}

// countOlder counts the checkpoints behind cp through previous links (a
// hostile cycle ends where it closes).
func (inv *inventory) countOlder(cp *checkpoint) int {
	seen := map[digest.Digest]bool{cp.digest: true}
	n := 0
	for p := inv.checkpoints[cp.previous]; p != nil && !seen[p.digest]; p = inv.checkpoints[p.previous] {
		seen[p.digest] = true
		n++
	}
	return n
}

// sameRepo says whether ref is in the repository prune works on.
func (inv *inventory) sameRepo(ref ociimage.Reference) bool {
	return ociimage.SameRepository(inv.repo, ref)
}

// prunePlan is what to delete, in order.
type prunePlan struct {
	kept, removed []*checkpoint // newest first
	// images to delete with each removed checkpoint (by its digest), and
	// those left, with why.
	images map[digest.Digest][]digest.Digest
	kinds  map[digest.Digest]string // the part each of those is listed as
	left   []api.PrunedImage
	// companions are the manifests to delete after a manifest, by its
	// digest: those its tag-named companions name (companionTags).
	companions map[digest.Digest][]digest.Digest
	// roots are what a layout's garbage collection must keep besides what
	// index.json lists: the kept checkpoints and the images they need.
	roots []digest.Digest
}

// planPrune orders the checkpoints, newest first, and decides what goes.
// Ties in time (the annotation has seconds) go to the one with more
// checkpoints behind it, which is the newer within a chain.
func planPrune(inv *inventory, keep int) *prunePlan {
	p := &prunePlan{images: map[digest.Digest][]digest.Digest{}, kinds: map[digest.Digest]string{}, companions: map[digest.Digest][]digest.Digest{}}
	for _, d := range slices.Sorted(maps.Keys(inv.unreadable)) {
		why := inv.unreadable[d]
		p.left = append(p.left, api.PrunedImage{Image: inv.repo.WithDigest(d).String(), Tags: inv.tags[d],
			Reason: "a checkpoint prune cannot read, left alone: " + why})
		p.roots = append(p.roots, d) // a layout's collection keeps it
	}
	var dated []*checkpoint
	for _, cp := range inv.checkpoints {
		if cp.dated {
			dated = append(dated, cp)
		} else {
			p.kept = append(p.kept, cp) // when it was taken is not known: never pruned
		}
	}
	slices.SortFunc(dated, func(a, b *checkpoint) int {
		return cmp.Or(b.created.Compare(a.created), cmp.Compare(b.older, a.older), strings.Compare(string(a.digest), string(b.digest)))
	})
	keep = min(keep, len(dated))
	p.kept = append(dated[:keep:keep], p.kept...)
	p.removed = dated[keep:]

	needed := map[digest.Digest]bool{}
	for _, cp := range p.kept {
		needed[cp.digest] = true
		p.roots = append(p.roots, cp.digest)
		for _, d := range inv.linked(cp) {
			needed[d] = true
			p.roots = append(p.roots, d)
		}
	}
	deleted := map[digest.Digest]bool{}
	for _, cp := range slices.Backward(p.removed) {
		deleted[cp.digest] = true
		for _, part := range cp.images {
			ref := part.Ref
			switch {
			case !inv.sameRepo(ref):
				p.left = append(p.left, api.PrunedImage{Image: ref.String(), Reason: "in another repository: prune deletes only in " + inv.repo.String()})
			case needed[ref.Digest]:
				p.left = append(p.left, api.PrunedImage{Image: ref.String(), Tags: inv.tags[ref.Digest], Reason: "a kept checkpoint needs it"})
			case len(inv.tags[ref.Digest]) > 0:
				// A tag is a reference too: someone may still want it.
				p.left = append(p.left, api.PrunedImage{Image: ref.String(), Tags: inv.tags[ref.Digest], Reason: "still tagged"})
			case !deleted[ref.Digest] && inv.checkpoints[ref.Digest] == nil:
				deleted[ref.Digest] = true
				p.images[cp.digest] = append(p.images[cp.digest], ref.Digest)
				p.kinds[ref.Digest] = part.Name
			}
		}
	}
	// A manifest's companions go when it goes, each only if no other tag
	// names it.
	for d := range deleted {
		for _, tag := range companionTags(d) {
			c, ok := inv.tagged[tag]
			if ok && !needed[c] && !deleted[c] && len(inv.tags[c]) == 1 {
				p.companions[d] = append(p.companions[d], c)
			}
		}
	}
	return p
}

// companionTags are the tags of what exists only for the manifest d: its
// referrers fallback index (sha256-HEX, the manifests whose subject is
// d) and its cosign signatures (sha256-HEX.sig).
func companionTags(d digest.Digest) []string {
	return []string{fallbackTag(d), ociimage.SignatureTag(d)}
}

// linked are the digests of cp's images in the repository: its disk and
// rootfs images and its subject.
func (inv *inventory) linked(cp *checkpoint) []digest.Digest {
	var out []digest.Digest
	for _, p := range cp.images {
		if inv.sameRepo(p.Ref) {
			out = append(out, p.Ref.Digest)
		}
	}
	if cp.subject != "" {
		out = append(out, cp.subject)
	}
	return out
}

// checkKinds leaves out of the deletions an image that is not the part its
// checkpoint lists it as (a VM state image, a disk image, a container
// image): a checkpoint, which anyone who may push can write, must not be
// able to get some other image deleted by naming it.
func (p *prunePlan) checkKinds(ctx context.Context, repo pruneRepo) error {
	for cp, ds := range p.images {
		var keep []digest.Digest
		for _, d := range ds {
			desc, err := repo.ResolveDigest(ctx, d)
			if errors.Is(err, ociimage.ErrNotFound) {
				keep = append(keep, d) // gone already; its companions may not be
				continue
			}
			if err != nil {
				return err
			}
			m, err := repo.Manifest(ctx, desc)
			if err == nil && isKind(m, p.kinds[d]) {
				keep = append(keep, d)
				continue
			}
			p.left = append(p.left, api.PrunedImage{Image: repo.Reference().WithDigest(d).String(),
				Reason: "not the " + p.kinds[d] + " image its checkpoint lists it as"})
		}
		p.images[cp] = keep
	}
	return nil
}

// isKind says whether m is the image a checkpoint's part of that name is.
func isKind(m ocispec.Manifest, part string) bool {
	switch part {
	case ociimage.PartVMState:
		return m.ArtifactType == ociimage.ArtifactTypeVMState
	case ociimage.PartDisk:
		return m.ArtifactType == ociimage.ArtifactTypeDisk
	case ociimage.PartRootfs:
		return m.ArtifactType == "" && m.Config.MediaType == ocispec.MediaTypeImageConfig
	}
	return false
}

func fallbackTag(d digest.Digest) string { return d.Algorithm().String() + "-" + d.Encoded() }

// run deletes what the plan says: the oldest checkpoint first, its images
// before its state manifest (which is how prune would find them again), and
// a manifest's companions right after it.
func (p *prunePlan) run(ctx context.Context, repo pruneRepo) error {
	del := func(what string, d digest.Digest) error {
		if err := step(what + " " + d.String()); err != nil {
			return err
		}
		if err := repo.DeleteManifest(ctx, d); err != nil {
			return err
		}
		for _, c := range p.companions[d] {
			if err := step("companion " + c.String() + " of " + d.String()); err != nil {
				return err
			}
			if err := repo.DeleteManifest(ctx, c); err != nil {
				return err
			}
		}
		return nil
	}
	for _, cp := range slices.Backward(p.removed) {
		for _, d := range p.images[cp.digest] {
			if err := del("image", d); err != nil {
				return err
			}
		}
		if err := del("checkpoint", cp.digest); err != nil {
			return err
		}
	}
	return nil
}

// result describes the plan, deleted or (dry run) to delete.
func (p *prunePlan) result(inv *inventory, repo string, s PruneSpec) *api.PruneResult {
	res := &api.PruneResult{Repository: repo, Keep: s.Keep, DryRun: s.DryRun, Kept: []api.PrunedCheckpoint{}, Removed: []api.PrunedCheckpoint{}, LeftImages: p.left}
	describe := func(cp *checkpoint) api.PrunedCheckpoint {
		out := api.PrunedCheckpoint{Digest: cp.digest.String(), Tags: inv.tags[cp.digest], Previous: cp.previous.String(), Undated: !cp.dated}
		if cp.dated {
			t := cp.created
			out.Created = &t
		}
		for _, p := range cp.images {
			out.Images = append(out.Images, p.Ref.String())
		}
		return out
	}
	for _, cp := range p.kept {
		res.Kept = append(res.Kept, describe(cp))
	}
	addTags := func(d digest.Digest) {
		res.RemovedTags = append(res.RemovedTags, inv.tags[d]...)
		for _, c := range p.companions[d] {
			res.RemovedTags = append(res.RemovedTags, inv.tags[c]...)
		}
	}
	for _, cp := range p.removed {
		res.Removed = append(res.Removed, describe(cp))
		addTags(cp.digest)
		for _, d := range p.images[cp.digest] {
			res.RemovedImages = append(res.RemovedImages, api.PrunedImage{Image: inv.repo.WithDigest(d).String(), Tags: inv.tags[d]})
			addTags(d)
		}
	}
	slices.Sort(res.RemovedTags)
	return res
}

// PruneAfterCheckpoint applies retention to the repository of a state
// image reference after a successful checkpoint. A failure is reported in
// the result, not as the checkpoint's: the checkpoint is committed.
func PruneAfterCheckpoint(ctx context.Context, image string, keep int, opts []ociimage.Option) *api.PruneResult {
	repo := image
	if ref, err := ociimage.ParseReference(image); err == nil {
		ref.Tag = ""
		repo = ref.WithDigest("").String()
	}
	res, err := Prune(ctx, PruneSpec{Repo: repo, Keep: keep, Store: opts})
	if err != nil {
		e := api.ErrorOf(errcode.Wrap(errcode.Of(err), err, "the checkpoint succeeded, but pruning %s after it failed", repo))
		return &api.PruneResult{Repository: repo, Keep: keep, Kept: []api.PrunedCheckpoint{}, Removed: []api.PrunedCheckpoint{}, Error: &e}
	}
	return res
}

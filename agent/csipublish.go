package agent

// The agent's side of the CSI node plugin (agent/csi): a pod's inline
// volume naming a memory-file state image gets the node's verified RAM
// file of it, read-only, through the mounter.

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/agent/csi"
	"github.com/vmsnap/vmsnap/agent/mounter"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// Mounter is what the publisher asks of the privileged mounter
// (mounter.Client): bind a publication onto a kubelet target, and undo it.
type Mounter interface {
	Publish(ctx context.Context, r mounter.PublishRequest) error
	Unpublish(ctx context.Context, r mounter.UnpublishRequest) error
}

// CSIPublisher is the csi.Publisher of this agent: it publishes through m.
func (s *Server) CSIPublisher(m Mounter) csi.Publisher { return &csiPublisher{s: s, m: m} }

type csiPublisher struct {
	s     *Server
	m     Mounter
	fills fills
}

// Publish fills the pod's namespace's cache as that namespace's prepare
// would (joining a fill under way), links the file into the publication pub.VolumeID and has the
// mounter bind it read-only onto the target. A kubelet retry finds the
// file (or waits for the fill under way) and the publication in place.
func (p *csiPublisher) Publish(ctx context.Context, pub csi.Publication) error {
	res, err := p.prepare(ctx, pub)
	if err != nil {
		return err
	}
	if !mapsReadOnly(res.QEMUArgs) {
		return errcode.New(errcode.Usage, "%s was checkpointed by a QEMU before 8.2, which opens its RAM file read-write: this agent does not yet publish such images through a CSI volume; "+
			"restore it with vmsnap prepare into the pod's own volume, or checkpoint it with QEMU 8.2 or later", pub.Image)
	}
	cache := ramfile.Cache{Dir: RAMCacheDir(p.s.cfg.StateDir, pub.Pod.Namespace)}
	_, statErr := os.Lstat(cache.PublicationDir(pub.VolumeID))
	dir, err := cache.Publish(pub.VolumeID, digest.Digest(res.Digest), res.MemoryBytes)
	if err != nil {
		return err
	}
	err = p.m.Publish(ctx, mounter.PublishRequest{VolumeID: pub.VolumeID, PodUID: pub.Pod.UID, Target: pub.Target, Source: dir, ReadOnly: true})
	if err != nil && errors.Is(statErr, fs.ErrNotExist) {
		// Ours alone, and not mounted: it would pin the file for good.
		_ = cache.Unpublish(pub.VolumeID)
	}
	return err
}

// prepareFor runs the agent's prepare for the pod's namespace, as a caller
// in that namespace (never an admin, whatever the namespace): its
// repositories, keys and signatures, the node's bounds and the caller's
// operation limit. One way to fill the cache: a publish and a prepare of
// one image in one namespace wait for one fetch.
func (s *Server) prepareFor(ctx context.Context, pub csi.Publication) (*api.PrepareResult, error) {
	c := Caller{Namespace: pub.Pod.Namespace, Pod: pub.Pod.Name, Container: "(csi volume " + pub.VolumeID + ")"}
	return s.prepareAndWait(withCaller(ctx, c), api.PrepareRequest{Image: pub.Image})
}

// mapsReadOnly says whether a prepare's QEMU arguments map the file
// read-only (QEMU 8.2 and later: readonly=on,rom=off).
func mapsReadOnly(qemuArgs []string) bool {
	return slices.ContainsFunc(qemuArgs, func(a string) bool {
		return strings.HasPrefix(a, "memory-backend-file,") && slices.Contains(strings.Split(a, ","), "readonly=on")
	})
}

// Unpublish has the mounter unmount the target, then removes the
// publication: unmounted first, so that a pod never sees it emptied.
func (p *csiPublisher) Unpublish(ctx context.Context, volumeID, target string) error {
	if err := p.m.Unpublish(ctx, mounter.UnpublishRequest{VolumeID: volumeID, Target: target}); err != nil {
		return err
	}
	// The request does not say the namespace; volume ids are unique on a
	// node, so the publication is in at most one namespace's cache.
	root := filepath.Join(p.s.cfg.StateDir, "ram")
	des, err := os.ReadDir(root)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return errcode.Wrap(errcode.Internal, err, "reading the RAM caches")
	}
	for _, de := range des {
		if de.IsDir() && isDNSLabel(de.Name()) {
			if err := (ramfile.Cache{Dir: RAMCacheDir(p.s.cfg.StateDir, de.Name())}).Unpublish(volumeID); err != nil {
				return err
			}
		}
	}
	return nil
}

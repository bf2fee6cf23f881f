package vmstate

import (
	"context"
	"fmt"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// checkChain checks the chain's links against the manifest's RAM layers:
// in the pack format the packs its links added are the manifest's; in
// the region-layer format of earlier versions, its region layers.
func (c *RAMConfig) checkChain(ram ramfile.Layers) error {
	regions, packs := 0, 0
	for i, l := range c.Chain {
		if l.Regions < 0 || l.Packs < 0 || (i < len(c.Chain)-1 && l.Manifest.Validate() != nil) {
			return errcode.New(errcode.InvalidInput, "the image's chain link %d is malformed", i)
		}
		regions += l.Regions
		packs += l.Packs
	}
	switch {
	case ram.Index != nil && packs != len(ram.Packs):
		return errcode.New(errcode.InvalidInput, "the image's chain adds up to %d packs, its manifest lists %d", packs, len(ram.Packs))
	case ram.Index == nil && (packs != 0 || regions != len(ram.Regions)):
		return errcode.New(errcode.InvalidInput, "the image's chain adds up to %d region layers, its manifest lists %d", regions, len(ram.Regions))
	}
	return nil
}

// loadIndex reads the parent's index, which the delta's extends, before
// the VM stops. A parent in the region-layer format of earlier versions
// cannot carry a delta in packs: why says so, and the checkpoint is a
// base.
func (p *parentImage) loadIndex(ctx context.Context, repo ociimage.Repository) (string, error) {
	if p.ram.Index == nil {
		return "it is in the region-layer format of an earlier vmsnap", nil
	}
	x, err := ramfile.LoadIndex(ctx, p.ram, repo, p.cfg.RAM.Bytes)
	p.index = x
	return "", err
}

// parentIndex is the parent's index, nil for a base.
func (c *memFileCheckpoint) parentIndex() *ramfile.Index {
	if c.parent == nil {
		return nil
	}
	return c.parent.index
}

// chainTooLong says why the capture cannot be a delta on its parent ("" if
// it can): its index would pass ramfile.MaxIndexBytes, or its manifest
// ramfile.MaxRegionLayers packs.
func (c *memFileCheckpoint) chainTooLong(scanErr error) string {
	if scanErr != nil || c.parent == nil {
		return ""
	}
	regions := c.capture.Regions()
	if n := ramfile.IndexBytes(c.parent.index, regions); n > ramfile.MaxIndexBytes {
		return fmt.Sprintf("the chain's RAM index would take %d MiB, more than %d: a fresh base", n>>20, ramfile.MaxIndexBytes>>20)
	}
	if n := len(c.parent.ram.Packs) + ramfile.PacksFor(regions); n > ramfile.MaxRegionLayers {
		return fmt.Sprintf("the chain could list %d packs, more than %d: a fresh base", n, ramfile.MaxRegionLayers)
	}
	return ""
}

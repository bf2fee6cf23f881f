package ramfile

import "github.com/vmsnap/vmsnap/internal/errcode"

// Parent is the checkpoint a delta builds on, as a capture compares the
// RAM file with it: its page map, and whether that map must be checked.
//
// A page whose fast hash matches the parent's is not stored: the delta
// takes it from the parent's layers, on the word of the parent's strong
// hash, which becomes the delta's own. So the map decides what a restore
// of the delta gives, and must be trusted as far as the delta is:
//
//   - a map the node computed itself from this VM's memory (its record of
//     the VM's last checkpoint) needs no check (Verify false);
//   - any other (a parent named by a user) is checked against the memory
//     being captured: a page whose fast hash matches is taken as unchanged
//     only if its SHA-256 matches the map's too, and stored otherwise
//     (Verify true). That costs a SHA-256 of each such page.
//
// A prepare checks every page it materialized against the delta's map
// (Verify), so parent layers that do not hold what the map says refuse
// the image instead of giving other memory.
type Parent struct {
	Map    *PageMap
	Verify bool
}

// check refuses a parent whose map is not for a RAM file of pages pages.
func (p *Parent) check(pages int) error {
	if p != nil && (p.Map == nil || p.Map.Len() != pages) {
		n := 0
		if p.Map != nil {
			n = p.Map.Len()
		}
		return errcode.New(errcode.InvalidInput, "the parent's page map has %d pages, the RAM file %d", n, pages)
	}
	return nil
}

// unchanged says whether a page of fast hash h at page i, whose content
// is page, is the parent's; refuted, whether its fast hash matched but its
// strong hash did not.
func (p *Parent) unchanged(i int, h uint64, page []byte) (same, refuted bool) {
	if p == nil || p.Map.Fast(i) != h {
		return false, false
	}
	// A page of zeros is one, whatever hashes say (h is 0 only for zeros).
	if p.Verify && h != 0 && strongHashOf(page) != p.Map.Strong(i) {
		return false, true
	}
	return true, false
}

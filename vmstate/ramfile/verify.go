package ramfile

import (
	"context"
	"os"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// Verify checks every page of the RAM file f (size bytes, which nothing
// may write meanwhile) against the page map of layers, both hashes: a data
// page must have its entry's xxhash64 and SHA-256, a page of zeros (a hole
// included) an entry of zeros. A mismatch is DIGEST_MISMATCH: the region
// layers do not give what the image's map says (a forged or corrupt
// parent), and no QEMU may map the file.
//
// The map is streamed layer by layer (entryReader), so what Verify holds
// is fixed whatever RAM size the image declares. With keep it returns the
// verified map as well, 24 bytes per data page of the file: what a node
// records of an image it prepared for a VM to be checkpointed again.
func Verify(ctx context.Context, layers Layers, src chunk.BlobSource, f *os.File, size int64, keep bool) (*PageMap, error) {
	if err := CheckSize(size); err != nil {
		return nil, err
	}
	pages := Pages(size)
	er, err := newEntryReader(ctx, layers.PageMap, src, pages)
	if err != nil {
		return nil, err
	}
	defer er.close()
	var m *PageMap
	if keep {
		m = newPageMap(pages)
	}
	// check compares page er.next, of hashes fast and strong, with its entry.
	check := func(fast uint64, strong strongHash) error {
		i := er.next
		e, err := er.read()
		switch {
		case err != nil:
			return err
		case e.fast != fast:
			return pageMismatch(i, "its xxhash64 differs")
		case fast != 0 && e.strong != strong:
			return pageMismatch(i, "its SHA-256 differs")
		}
		if m != nil {
			m.addEntry(i, e)
		}
		return nil
	}
	zerosUpTo := func(end int) error {
		for er.next < end {
			if err := check(0, strongHash{}); err != nil {
				return err
			}
		}
		return nil
	}
	err = hashFile(f, size, hashStrong, func(win *window) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := zerosUpTo(win.firstPage()); err != nil {
			return err
		}
		for k, h := range win.hashes {
			if err := check(h, win.strong[k]); err != nil {
				return err
			}
		}
		return nil
	})
	if err == nil {
		err = zerosUpTo(pages)
	}
	if err == nil {
		err = er.finish()
	}
	if err != nil {
		return nil, err
	}
	if m != nil {
		m.finish()
	}
	return m, nil
}

// hashStrong computes the strong hash of each of win's data pages.
func hashStrong(win *window) {
	win.strong = make([]strongHash, len(win.hashes))
	for k, h := range win.hashes {
		if h != 0 {
			win.strong[k] = strongHashOf(win.page(k))
		}
	}
}

func pageMismatch(page int, why string) error {
	return errcode.New(errcode.DigestMismatch, "page %d of the RAM file does not match the image's page map (%s): the image's layers hold other pages than its map says (a forged or corrupt parent?); nothing was loaded", page, why)
}

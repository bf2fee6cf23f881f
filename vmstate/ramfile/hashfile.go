package ramfile

import (
	"os"
	"runtime"
	"sync"
	"syscall"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// scanWindow is how much of the RAM file hashFile maps (or reads) at a
// time.
const scanWindow = 2 << 20

// window is a piece of the RAM file being hashed.
type window struct {
	off    int64
	n      int
	data   []byte
	hashes []uint64 // the fast hash of each of its pages
	// strong holds the strong hash of the pages the hash step chose (the
	// others are left zero); refuted marks the pages whose fast hash
	// matched an unverified parent's but whose strong hash did not.
	strong  []strongHash
	refuted []bool
	unmap   func()
	err     error
	ready   chan struct{} // closed once hashed, or err set
}

// page is the window's k-th page.
func (w *window) page(k int) []byte { return w.data[k*PageSize : (k+1)*PageSize] }

// firstPage is the index in the file of the window's first page.
func (w *window) firstPage() int { return int(w.off / PageSize) }

// hashFile reads the data extents of f's first size bytes (a hole is zero
// pages, never read), window by window, computes each window's fast hashes
// and then calls hash on it, and calls visit with the windows in file
// order.
//
// The pages are read where they are, through windows of the file mapped
// read-only, not copied out by read(2): on tmpfs that copy was most of a
// scan's time, and the VM is stopped meanwhile. Workers (one per CPU, up
// to 4) map and hash windows in parallel; this goroutine visits each window
// in order and unmaps it. At most two windows per worker are mapped at
// once, so the resident set holds a few MiB of the file, whatever its size.
// hash and visit read the mapping: a file that shrinks meanwhile is an
// error (readMapped), not the end of the process.
func hashFile(f *os.File, size int64, hash func(*window), visit func(*window) error) error {
	var wins []*window
	if err := dataExtents(f, size, func(start, end int64) error {
		for off := start; off < end; off += scanWindow {
			wins = append(wins, &window{off: off, n: int(min(scanWindow, end-off)), ready: make(chan struct{})})
		}
		return nil
	}); err != nil {
		return err
	}
	workers := max(1, min(runtime.GOMAXPROCS(0), 4))
	slots := make(chan struct{}, 2*workers)
	jobs := make(chan *window)
	done := make(chan struct{})
	var wg sync.WaitGroup
	go func() {
		defer close(jobs)
		for _, win := range wins {
			select {
			case slots <- struct{}{}:
			case <-done:
				return
			}
			select {
			case jobs <- win:
			case <-done:
				return
			}
		}
	}()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for win := range jobs {
				win.err = readMapped(win, func() error {
					if err := mapWindow(f, win); err != nil {
						return err
					}
					if hash != nil {
						hash(win)
					}
					return nil
				})
				close(win.ready)
			}
		}()
	}
	next := 0
	defer func() {
		// On an error: let the workers finish, and unmap what they mapped.
		close(done)
		wg.Wait()
		for _, win := range wins[next:] {
			select {
			case <-win.ready:
				if win.unmap != nil {
					win.unmap()
				}
			default:
			}
		}
	}()
	for ; next < len(wins); next++ {
		win := wins[next]
		<-win.ready
		err := win.err
		if err == nil {
			err = readMapped(win, func() error { return visit(win) })
		}
		if win.unmap != nil {
			win.unmap()
		}
		<-slots
		if err != nil {
			next++
			return err
		}
	}
	return nil
}

// mapWindow maps (or, failing that, reads) win and computes its fast
// hashes.
func mapWindow(f *os.File, win *window) error {
	b, err := syscall.Mmap(int(f.Fd()), win.off, win.n, syscall.PROT_READ, syscall.MAP_SHARED|syscall.MAP_POPULATE)
	if err == nil {
		win.data, win.unmap = b, func() { _ = syscall.Munmap(b) }
	} else {
		win.data = make([]byte, win.n)
		if _, err := f.ReadAt(win.data, win.off); err != nil {
			return errcode.Wrap(errcode.Internal, err, "reading the RAM file at %d", win.off)
		}
	}
	win.hashes = make([]uint64, win.n/PageSize)
	for k := range win.hashes {
		win.hashes[k] = fastHash(win.page(k))
	}
	return nil
}

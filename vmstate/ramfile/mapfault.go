package ramfile

import (
	"runtime/debug"
	"unsafe"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// readMapped runs fn, which reads win's pages through a mapping of a RAM
// file. The file may be someone else's (a tenant's volume), who can
// truncate it while it is read: a page past its new end then faults
// (SIGBUS), which a Go program survives only as a panic it asked for
// (debug.SetPanicOnFault, per goroutine). A fault inside win's mapping is
// an error here; any other panic goes on.
func readMapped(win *window, fn func() error) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		if f, ok := r.(interface{ Addr() uintptr }); !ok || !win.holds(f.Addr()) {
			panic(r)
		}
		err = errcode.New(errcode.InvalidInput, "the RAM file shrank while vmsnap read it (something truncated it): nothing was taken from it")
	}()
	return fn()
}

// holds says whether addr is in the window's mapping.
func (w *window) holds(addr uintptr) bool {
	if w.unmap == nil || len(w.data) == 0 {
		return false // read into memory of ours: no file behind it
	}
	start := uintptr(unsafe.Pointer(unsafe.SliceData(w.data)))
	return addr >= start && addr < start+uintptr(len(w.data))
}

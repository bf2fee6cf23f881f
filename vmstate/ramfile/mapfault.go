package ramfile

import (
	"runtime/debug"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// readMapped runs fn, which reads pages of a RAM file through a mapping.
// The file may be someone else's (a tenant's volume), who can truncate it
// while it is read: a page past its new end then faults (SIGBUS), which a
// Go program survives only as a panic it asked for (debug.SetPanicOnFault,
// per goroutine). That fault is an error here; any other panic goes on.
func readMapped(fn func() error) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		if _, fault := r.(interface{ Addr() uintptr }); !fault {
			panic(r)
		}
		err = errcode.New(errcode.InvalidInput, "the RAM file shrank while vmsnap read it (something truncated it): nothing was taken from it")
	}()
	return fn()
}

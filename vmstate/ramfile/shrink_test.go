package ramfile

import (
	"bufio"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// A tenant's RAM file is on its own volume: while the agent reads it through
// a mapping, another process of the pod truncates it. A read of a mapped page
// past the file's new end faults (SIGBUS), which ends a Go process unless
// the read is made to panic instead: the agent, with every other tenant's
// checkpoint in flight (their VMs stopped), must get an error.
func TestHashFileSurvivesTheFileShrinking(t *testing.T) {
	for _, tc := range []struct {
		name string
		// shrinkIn says in which step the file shrinks: the workers' hash
		// (a verified parent's SHA-256) or the visit (the copy aside).
		inHash bool
	}{{"while the workers hash", true}, {"while the pages are copied aside", false}} {
		t.Run(tc.name, func(t *testing.T) {
			f := ramFile(t, rand.New(rand.NewPCG(7, 7)))
			var once sync.Once
			shrink := func() {
				once.Do(func() {
					if err := f.Truncate(0); err != nil {
						t.Error(err)
					}
				})
			}
			w := bufio.NewWriter(io.Discard)
			var hash func(*window)
			if tc.inHash {
				hash = func(win *window) {
					shrink()
					for k := range win.hashes {
						_ = strongHashOf(win.page(k))
					}
				}
			}
			visits := 0
			err := hashFile(f, testSize, hash, func(win *window) error {
				visits++
				if !tc.inHash {
					shrink()
				}
				for k := range win.hashes {
					if _, err := w.Write(win.page(k)); err != nil {
						return err
					}
				}
				return nil
			})
			if err == nil {
				t.Fatalf("the RAM file shrank to nothing during the scan, and hashFile read on (%d windows visited) without an error", visits)
			}
			if errcode.Of(err) != errcode.InvalidInput || !strings.Contains(err.Error(), "shrank") {
				t.Fatalf("got %v (code %s), want INVALID_INPUT saying the RAM file shrank", err, errcode.Of(err))
			}
		})
	}
}

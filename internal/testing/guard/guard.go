// Package guard keeps a test that performs an attack from taking the
// machine down when the code under test falls for it: a read without end
// ends the test binary before it exhausts the machine's memory, and a call
// that blocks for good fails the test instead of hanging it. Only tests
// use it.
package guard

import (
	"fmt"
	"runtime"
	"testing"
	"time"
)

// Within runs fn and returns what it returned. It fails t if fn has not
// returned within d (fn's goroutine is left behind: it may never return),
// and panics, which ends the test binary with the message, if the Go heap
// grows past maxHeap bytes meanwhile.
func Within[T any](t testing.TB, d time.Duration, maxHeap uint64, what string, fn func() T) T {
	t.Helper()
	done := make(chan T, 1)
	go func() { done <- fn() }()
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case v := <-done:
			return v
		case <-deadline.C:
			t.Fatalf("%s did not return within %v: it is blocked on something that does not answer", what, d)
		case <-tick.C:
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			if ms.HeapAlloc > maxHeap {
				panic(fmt.Sprintf("%s holds %d MiB of memory, more than %d MiB: a read without bound", what, ms.HeapAlloc>>20, maxHeap>>20))
			}
		}
	}
}

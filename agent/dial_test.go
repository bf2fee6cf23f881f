//go:build linux

package agent

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// A full listen queue (another caller's flood) makes connect() fail with
// EAGAIN at once; the client waits it out instead of reporting an agent
// that does not answer.
func TestClientWaitsOutAFullListenQueue(t *testing.T) {
	dir, err := os.MkdirTemp("", "vmsnap-dial-") // short: a socket path holds 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "s")
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil { // one connection waits, no more
		t.Fatal(err)
	}
	first, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if _, err := net.Dial("unix", path); !errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("a plain connect to a full queue: %v, want EAGAIN (the test proves nothing otherwise)", err)
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		if nfd, _, err := syscall.Accept(fd); err == nil {
			syscall.Close(nfd)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := dialAgent(ctx, path)
	if err != nil {
		t.Fatalf("the client gave up on a queue that frees up: %v", err)
	}
	c.Close()
}

// The same process is placed once: its next connection is placed from
// the cache, by pid and start time; another start time is another process.
func TestPlacedCache(t *testing.T) {
	var pc placedCache
	c := Caller{Namespace: "tenant-a", PID: 42}
	pc.put(42, time.Second, c)
	if got, ok := pc.get(42, time.Second); !ok || got != c {
		t.Fatalf("the same process: %+v, %v", got, ok)
	}
	if _, ok := pc.get(42, 2*time.Second); ok {
		t.Fatal("a process that reused the pid was taken for the cached one")
	}
	pc.mu.Lock()
	e := pc.byPID[42]
	e.until = time.Now().Add(-time.Millisecond)
	pc.byPID[42] = e
	pc.mu.Unlock()
	if _, ok := pc.get(42, time.Second); ok {
		t.Fatal("an expired entry answered")
	}
	for pid := range int32(placedMax + 10) {
		pc.put(1000+pid, time.Second, c)
	}
	if len(pc.byPID) > placedMax || len(pc.order) > placedMax {
		t.Fatalf("%d entries, %d in order: over %d", len(pc.byPID), len(pc.order), placedMax)
	}
}

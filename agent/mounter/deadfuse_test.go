package mounter

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/testing/guard"
)

// mountUnservedFUSE mounts a FUSE file system on dir whose /dev/fuse
// descriptor nobody reads: every request to it waits for good, as it would
// on a server that is stopped while the mounter (or the agent) still holds
// the connection. Cleanup closes the descriptor, which aborts the
// connection and frees anything stuck on it.
func mountUnservedFUSE(t *testing.T, dir string) *os.File {
	t.Helper()
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("opening /dev/fuse (the test needs FUSE): %v", err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", dev.Fd())
	if err := unix.Mount("vmsnap-test", dir, "fuse", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		t.Fatalf("mounting an unserved FUSE file system: %v", err)
	}
	t.Cleanup(func() {
		dev.Close()
		unix.Unmount(dir, unix.MNT_DETACH)
	})
	return dev
}

// stalledOnFUSE says whether one of this process's threads waits for a
// FUSE server (the kernel's wait channel says so).
func stalledOnFUSE() bool {
	waits, _ := filepath.Glob("/proc/self/task/*/wchan")
	for _, w := range waits {
		b, err := os.ReadFile(w)
		if err == nil && (strings.HasPrefix(string(b), "fuse_") || strings.HasPrefix(string(b), "request_wait_answer")) {
			return true
		}
	}
	return false
}

// TestStopsDespiteAStalledPublish: a publish blocked in the kernel on a
// FUSE server that does not answer cannot be cancelled; the mounter stops
// anyway (after its grace period) rather than never.
func TestStopsDespiteAStalledPublish(t *testing.T) {
	requireRoot(t)
	fuseDir := t.TempDir()
	f := newFixture(t, func(s *setup) {
		s.cfg.PublicationRoots = append(s.cfg.PublicationRoots, fuseDir)
		s.shutdownGrace = 100 * time.Millisecond
	})
	// Mounted after the fixture started, so that its cleanup (which
	// aborts the connection and frees the stalled request) runs before
	// the fixture's, which waits for the server.
	mountUnservedFUSE(t, fuseDir)
	r := f.volume(t, testUID, "ram")
	r.Source = fuseDir + "/" + r.VolumeID
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go f.client.Publish(ctx, r)
	guard.Within(t, time.Minute, 1<<30, "the publish reaching the FUSE server", func() bool {
		for !stalledOnFUSE() {
			time.Sleep(10 * time.Millisecond)
		}
		return true
	})
	must(t, guard.Within(t, time.Minute, 1<<30, "stopping the mounter", f.stop))
}

// TestUnpublishUnservedFUSE: a publication whose FUSE server does not
// answer (stalled, or dead while someone still holds the connection) is
// unpublished without a single request to it, so promptly, and its
// target removed.
func TestUnpublishUnservedFUSE(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	must(t, os.Mkdir(r.Target, 0o750))
	mountUnservedFUSE(t, r.Target)
	err := guard.Within(t, time.Minute, 1<<30, "unpublishing an unserved FUSE mount", func() error {
		return f.client.Unpublish(context.Background(), unpublishOf(r))
	})
	must(t, err)
	noMountsIn(t, r.Target)
	if exists(r.Target) {
		t.Fatal("the target directory is still there")
	}
}

// TestUnpublishAbortedFUSE: the same when the server is gone with its
// connection (every request fails with ENOTCONN).
func TestUnpublishAbortedFUSE(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	must(t, os.Mkdir(r.Target, 0o750))
	mountUnservedFUSE(t, r.Target).Close()
	must(t, f.client.Unpublish(context.Background(), unpublishOf(r)))
	noMountsIn(t, r.Target)
	if exists(r.Target) {
		t.Fatal("the target directory is still there")
	}
}

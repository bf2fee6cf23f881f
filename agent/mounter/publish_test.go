package mounter

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// TestPublishReadOnly: a read-only publication shows the source, refuses
// writes with EROFS, and holds nosuid, nodev and noexec: an executable
// does not run and a device node does not open.
func TestPublishReadOnly(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	true_, err := exec.LookPath("true")
	must(t, err)
	b, err := os.ReadFile(true_)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(r.Source, "prog"), b, 0o755))
	must(t, unix.Mknod(filepath.Join(r.Source, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	if err := exec.Command(filepath.Join(r.Source, "prog")).Run(); err != nil {
		t.Fatalf("the executable does not run from its source, so noexec cannot be told apart: %v", err)
	}
	must(t, f.client.Publish(context.Background(), r))

	got, err := os.ReadFile(r.Target + "/marker")
	if err != nil || string(got) != r.VolumeID {
		t.Fatalf("target shows %q, %v; want the publication's marker", got, err)
	}
	if err := os.WriteFile(r.Target+"/marker", []byte("changed"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("writing through the read-only publication: %v, want EROFS", err)
	}
	if err := os.WriteFile(r.Target+"/new", nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("creating in the read-only publication: %v, want EROFS", err)
	}
	assertNoExecNoDev(t, r.Target)
	for _, o := range []string{"ro", "nosuid", "nodev", "noexec"} {
		if opts := mountOptions(t, r.Target); !slices.Contains(opts, o) {
			t.Errorf("target's mount options %q lack %s", opts, o)
		}
	}
}

// TestPublishReadWrite: a read-write publication takes writes (the FUSE
// server is what refuses them there) and is still nosuid, nodev, noexec.
func TestPublishReadWrite(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	r.ReadOnly = false
	true_, err := exec.LookPath("true")
	must(t, err)
	b, err := os.ReadFile(true_)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(r.Source, "prog"), b, 0o755))
	must(t, unix.Mknod(filepath.Join(r.Source, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(t, f.client.Publish(context.Background(), r))
	must(t, os.WriteFile(r.Target+"/new", []byte("x"), 0o644))
	if got, err := os.ReadFile(r.Source + "/new"); err != nil || string(got) != "x" {
		t.Fatalf("a write through the target did not reach the publication: %q, %v", got, err)
	}
	assertNoExecNoDev(t, r.Target)
	opts := mountOptions(t, r.Target)
	for _, o := range []string{"rw", "nosuid", "nodev", "noexec"} {
		if !slices.Contains(opts, o) {
			t.Errorf("target's mount options %q lack %s", opts, o)
		}
	}
}

func assertNoExecNoDev(t *testing.T, target string) {
	t.Helper()
	if err := exec.Command(target + "/prog").Run(); !errors.Is(err, unix.EACCES) {
		t.Errorf("running a program from the publication: %v, want EACCES (noexec)", err)
	}
	if dev, err := os.Open(target + "/null"); !errors.Is(err, unix.EACCES) {
		if dev != nil {
			dev.Close()
		}
		t.Errorf("opening a device node in the publication: %v, want EACCES (nodev)", err)
	}
}

// TestPublishTwiceIsIdempotent: the kubelet retries NodePublishVolume; the
// same request again succeeds and stacks no second mount, while a request
// for another mode on a published target is refused.
func TestPublishTwiceIsIdempotent(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	ctx := context.Background()
	must(t, f.client.Publish(ctx, r))
	must(t, f.client.Publish(ctx, r))
	if m := mountsBelow(t, r.Target); len(m) != 1 {
		t.Fatalf("after two publishes, mounts on the target: %q, want one", m)
	}
	rw := r
	rw.ReadOnly = false
	wantCode(t, "publishing read-write over the read-only publication", f.client.Publish(ctx, rw), errcode.Busy)
	if m := mountsBelow(t, r.Target); len(m) != 1 {
		t.Fatalf("after a refused publish, mounts on the target: %q, want one", m)
	}
}

// TestConcurrentPublishesMountOnce: the kubelet's retry can overlap the
// call it retries; publishes of one target at once leave one mount.
func TestConcurrentPublishesMountOnce(t *testing.T) {
	// Widen the window between the check and the mount: unserialized
	// publishes would all find the target unmounted and stack their
	// mounts. (The result does not depend on the pause.)
	f := newFixture(t, func(s *setup) { s.afterTargetOpen = func() { time.Sleep(20 * time.Millisecond) } })
	r := f.volume(t, testUID, "ram")
	errs := make(chan error, 8)
	for range cap(errs) {
		go func() { errs <- f.client.Publish(context.Background(), r) }()
	}
	for range cap(errs) {
		must(t, <-errs)
	}
	if m := mountsBelow(t, r.Target); len(m) != 1 {
		t.Fatalf("after %d publishes at once, mounts on the target: %q, want one", cap(errs), m)
	}
}

// TestUnpublishTwice: unpublish unmounts and removes the target; again,
// and for a volume never published, it is a success that does nothing.
func TestUnpublishTwice(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	ctx := context.Background()
	must(t, f.client.Publish(ctx, r))
	for i := range 2 {
		if err := f.client.Unpublish(ctx, unpublishOf(r)); err != nil {
			t.Fatalf("unpublish %d: %v", i+1, err)
		}
		noMountsIn(t, r.Target)
		if exists(r.Target) {
			t.Fatalf("unpublish %d left the target directory", i+1)
		}
	}
	if !exists(filepath.Join(r.Source, "marker")) {
		t.Fatal("unpublish touched the publication")
	}
	other := f.volume(t, testUID, "other")
	must(t, os.RemoveAll(filepath.Dir(other.Target)))
	if err := f.client.Unpublish(ctx, unpublishOf(other)); err != nil {
		t.Fatalf("unpublishing a volume whose directory is gone: %v", err)
	}
}

// TestPublicationIsNoPeerOfItsSource: in a shared mount (the kubelet's
// directory is one, and the cache may be on one), the publication gets a
// peer group of its own: shared, so that the host sees it, but not the
// source mount's, so that mounts below one never show below the other.
func TestPublicationIsNoPeerOfItsSource(t *testing.T) {
	f := newFixture(t, func(s *setup) { s.shared = true })
	r := f.volume(t, testUID, "ram")
	must(t, f.client.Publish(context.Background(), r))
	source, published := peerGroup(t, f.root), peerGroup(t, r.Target)
	if source == "" || published == "" || source == published {
		t.Fatalf("peer groups: the source's mount %q, the publication %q; want both shared, in different groups", source, published)
	}
}

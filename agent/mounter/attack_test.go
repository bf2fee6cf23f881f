package mounter

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

const otherUID = "5f0c2e1a-8d3b-4e6f-a1c9-0b7d2e4f6a83"

// TestPublishRefusesTargetsAndSourcesOutsideItsRoots: a compromised agent
// (or a bug) asks for a mount onto something that is not a kubelet CSI
// target of the requesting pod, or from something that is not a
// publication. Each is refused with FORBIDDEN and nothing is mounted.
func TestPublishRefusesTargetsAndSourcesOutsideItsRoots(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	other := f.volume(t, otherUID, "ram")
	decoyTarget := filepath.Join(f.decoy, testUID, "volumes/kubernetes.io~csi/ram/mount")
	must(t, os.MkdirAll(decoyTarget, 0o755))
	must(t, os.MkdirAll(filepath.Join(f.decoy, r.VolumeID), 0o755))
	must(t, os.MkdirAll(filepath.Join(f.pub, "ns/pub/elsewhere"), 0o755))
	for _, tc := range []struct {
		name string
		edit func(*PublishRequest)
	}{
		{"dot-dot in the target", func(p *PublishRequest) {
			p.Target = f.pods + "/" + testUID + "/volumes/kubernetes.io~csi/ram/../../../../../decoy/" + testUID + "/volumes/kubernetes.io~csi/ram/mount"
		}},
		{"dot-dot as the volume", func(p *PublishRequest) {
			p.Target = f.pods + "/" + testUID + "/volumes/kubernetes.io~csi/../mount"
		}},
		{"target outside the pods dir", func(p *PublishRequest) { p.Target = decoyTarget }},
		{"target beside the pods dir", func(p *PublishRequest) {
			p.Target = f.pods + "x/" + testUID + "/volumes/kubernetes.io~csi/ram/mount"
		}},
		{"target of another pod", func(p *PublishRequest) { p.Target = other.Target }},
		{"pod UID of another pod", func(p *PublishRequest) { p.PodUID = otherUID }},
		{"volume id of another volume", func(p *PublishRequest) { p.VolumeID = VolumeHandle(testUID, "other") }},
		{"not the mount leaf", func(p *PublishRequest) { p.Target = strings.TrimSuffix(p.Target, "/mount") }},
		{"another kind of volume", func(p *PublishRequest) {
			p.Target = strings.Replace(p.Target, "kubernetes.io~csi", "kubernetes.io~empty-dir", 1)
		}},
		{"source outside the roots", func(p *PublishRequest) { p.Source = filepath.Join(f.decoy, p.VolumeID) }},
		{"dot-dot in the source", func(p *PublishRequest) { p.Source = f.pub + "/../decoy/" + p.VolumeID }},
		{"source not named after the volume", func(p *PublishRequest) { p.Source = filepath.Join(f.pub, "ns/pub/elsewhere") }},
		{"source is a root", func(p *PublishRequest) { p.Source = f.pub }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := r
			tc.edit(&req)
			wantCode(t, "publish", f.client.Publish(context.Background(), req), errcode.Forbidden)
			noMountsIn(t, f.root)
		})
	}
}

// TestUnpublishRefusesTargetsOutsideThePodsDir: unpublish cannot be used
// to unmount something that is not a kubelet CSI target, nor a target
// under another volume's id.
func TestUnpublishRefusesTargetsOutsideThePodsDir(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	decoyTarget := filepath.Join(f.decoy, testUID, "volumes/kubernetes.io~csi/ram/mount")
	must(t, os.MkdirAll(decoyTarget, 0o755))
	must(t, unix.Mount(r.Source, decoyTarget, "", unix.MS_BIND, ""))
	req := unpublishOf(r)
	req.Target = decoyTarget
	wantCode(t, "unpublish outside the pods dir", f.client.Unpublish(context.Background(), req), errcode.Forbidden)
	req.Target = f.pods + "/" + testUID + "/../../decoy/" + testUID + "/volumes/kubernetes.io~csi/ram/mount"
	wantCode(t, "unpublish through ..", f.client.Unpublish(context.Background(), req), errcode.Forbidden)
	if m := mountsBelow(t, decoyTarget); len(m) != 1 {
		t.Fatalf("the mount outside the pods dir is gone: %q", m)
	}
	must(t, f.client.Publish(context.Background(), r))
	wrong := unpublishOf(r)
	wrong.VolumeID = VolumeHandle(otherUID, "ram")
	wantCode(t, "unpublish with another volume's id", f.client.Unpublish(context.Background(), wrong), errcode.Forbidden)
	if m := mountsBelow(t, r.Target); len(m) != 1 {
		t.Fatalf("a refused unpublish unmounted the target: %q", m)
	}
}

// TestPublishRefusesSymlinks: a symbolic link in place of any component
// of the target below the pods dir, or of the source below its root, is
// refused, though each leads to a directory of the expected shape.
func TestPublishRefusesSymlinks(t *testing.T) {
	parts := []string{testUID, "volumes", "kubernetes.io~csi", "ram", "mount"}
	for i := range parts {
		t.Run("target "+parts[i], func(t *testing.T) {
			f := newFixture(t)
			r := f.volume(t, testUID, "ram")
			linkComponent(t, f.pods, parts, i, f.decoy)
			wantCode(t, "publish", f.client.Publish(context.Background(), r), errcode.Forbidden)
			noMountsIn(t, f.root)
		})
	}
	srcParts := []string{"ns", "pub", VolumeHandle(testUID, "ram")}
	for i := range srcParts {
		t.Run("source "+srcParts[i], func(t *testing.T) {
			f := newFixture(t)
			r := f.volume(t, testUID, "ram")
			linkComponent(t, f.pub, srcParts, i, f.decoy)
			wantCode(t, "publish", f.client.Publish(context.Background(), r), errcode.Forbidden)
			noMountsIn(t, f.root)
		})
	}
}

// linkComponent replaces base/parts[0]/.../parts[i] by a symbolic link to
// a directory in decoy that holds the rest of the path.
func linkComponent(t *testing.T, base string, parts []string, i int, decoy string) {
	t.Helper()
	at := filepath.Join(append([]string{base}, parts[:i+1]...)...)
	to := filepath.Join(decoy, "link", parts[i])
	must(t, os.MkdirAll(filepath.Join(append([]string{to}, parts[i+1:]...)...), 0o755))
	must(t, os.RemoveAll(at))
	must(t, os.Symlink(to, at))
}

// TestPublishFollowsTheOpenedTarget: the volume directory is swapped for a
// symbolic link to a decoy after the mounter opened the target; the mount
// lands on the directory it opened, not on the decoy.
func TestPublishFollowsTheOpenedTarget(t *testing.T) {
	swap := make(chan [2]string, 1) // the volume directory, and the decoy its link leads to
	f := newFixture(t, func(s *setup) {
		s.afterTargetOpen = func() {
			p := <-swap
			must(t, os.Rename(p[0], p[0]+".orig"))
			must(t, os.Symlink(p[1], p[0]))
		}
	})
	r := f.volume(t, testUID, "ram")
	vol := filepath.Dir(r.Target)
	swap <- [2]string{vol, f.decoy}
	must(t, os.MkdirAll(filepath.Join(f.decoy, "mount"), 0o755))
	must(t, f.client.Publish(context.Background(), r))
	noMountsIn(t, f.decoy)
	if _, err := os.Stat(vol + ".orig/mount/marker"); err != nil {
		t.Fatalf("the publication is not on the directory the mounter opened: %v", err)
	}
}

// TestPublishRacesASymlinkFlipper: while a goroutine keeps swapping the
// pod's directory for a symbolic link to a decoy of the same shape and
// back, publishes and unpublishes either fail or land in the pods dir:
// never a mount in the decoy.
func TestPublishRacesASymlinkFlipper(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	pod := filepath.Join(f.pods, testUID)
	decoyPod := filepath.Join(f.decoy, testUID)
	must(t, os.MkdirAll(filepath.Join(decoyPod, "volumes/kubernetes.io~csi/ram/mount"), 0o755))
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		for !stop.Load() {
			must(t, os.Rename(pod, pod+".real"))
			must(t, os.Symlink(decoyPod, pod))
			must(t, os.Remove(pod))
			must(t, os.Rename(pod+".real", pod))
		}
	})
	ctx := context.Background()
	published := 0
	for range 1000 {
		if f.client.Publish(ctx, r) == nil {
			published++
		}
		if m := mountsBelow(t, f.decoy); len(m) > 0 {
			stop.Store(true)
			wg.Wait()
			t.Fatalf("a publish mounted in the decoy: %q", m)
		}
		f.client.Unpublish(ctx, unpublishOf(r)) // may fail while the link is in place
	}
	stop.Store(true)
	wg.Wait()
	t.Logf("%d of 1000 publishes succeeded while the pod directory flipped", published)
	must(t, f.client.Unpublish(ctx, unpublishOf(r)))
	noMountsIn(t, f.root)
}

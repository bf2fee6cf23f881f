package agent

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/agent/csi"
	"github.com/vmsnap/vmsnap/agent/mounter"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// fakeMounter records what the publisher asks (the real mounter's part is
// TestCSIPublish's).
type fakeMounter struct {
	mu        sync.Mutex
	published []mounter.PublishRequest
}

func (m *fakeMounter) Publish(_ context.Context, r mounter.PublishRequest) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.published = append(m.published, r)
	return nil
}

func (m *fakeMounter) Unpublish(context.Context, mounter.UnpublishRequest) error { return nil }

// A publish whose caller gave up (the kubelet's two-minute timeout) leaves
// its fill running, and the kubelet's retry uses that fill's file: one
// fetch. The fill is held at the cache's lock until the caller has gone.
func TestCSIPublishFillOutlivesTheCaller(t *testing.T) {
	root := t.TempDir()
	img, _, _ := memoryFileCheckpoint(t, "oci:"+filepath.Join(root, "tenant-a", "vms")+":vm", [3]int{10, 0, 2}, 4<<20)
	stateDir := t.TempDir()
	s := startAgentConfig(t, Config{StateDir: stateDir, Resolver: newStaticResolver(), LayoutRoot: root}).srv
	m := &fakeMounter{}
	p := s.CSIPublisher(m)

	cache := RAMCacheDir(stateDir, "tenant-a")
	if err := os.MkdirAll(cache, 0o700); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(cache, strings.Replace(img[strings.LastIndexByte(img, '@')+1:], ":", "-", 1)+".ram")
	lock, err := os.OpenFile(file+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}

	uid := "0b6a4a5e-35c1-4a7c-9f0e-6a2d3c1b9e11"
	pub := csi.Publication{VolumeID: mounter.VolumeHandle(uid, "ram"), Target: "/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi/ram/mount",
		Pod: csi.Pod{Namespace: "tenant-a", Name: "restore", UID: uid}, Image: img, ReadOnly: true}
	gone, cancel := context.WithCancel(context.Background())
	cancel() // the kubelet has given up already
	if err := p.Publish(gone, pub); errcode.Of(err) != errcode.Busy {
		t.Fatalf("a publish whose caller is gone: %v; want BUSY (still being fetched)", err)
	}
	unix.Flock(int(lock.Fd()), unix.LOCK_UN)
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(file); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the fill of a publish whose caller left did not go on: no %s", file)
		}
	}
	if err := p.Publish(context.Background(), pub); err != nil {
		t.Fatal(err)
	}
	if misses := testutil.ToFloat64(s.metrics.cache.misses.WithLabelValues("tenant-a")); misses != 1 {
		t.Errorf("tenant-a's cache misses: %v, want one fetch", misses)
	}
	if len(m.published) != 1 || !m.published[0].ReadOnly || m.published[0].Source != filepath.Join(cache, "pub", pub.VolumeID) {
		t.Errorf("the mounter was asked %+v; want one read-only publish of %s", m.published, filepath.Join(cache, "pub", pub.VolumeID))
	}
}

// --ram-cache-max-age: a prepare removes the namespace's files unused for
// longer, except one a publication links. Their age is set, not waited for.
func TestRAMCacheMaxAgeSparesPublished(t *testing.T) {
	root := t.TempDir()
	var imgs []string
	for _, name := range []string{"a", "b", "c"} {
		img, _, _ := memoryFileCheckpoint(t, "oci:"+filepath.Join(root, "tenant-a", name)+":vm", [3]int{10, 0, 2}, 1<<20)
		imgs = append(imgs, img)
	}
	stateDir := t.TempDir()
	s := startAgentConfig(t, Config{StateDir: stateDir, Resolver: newStaticResolver(), LayoutRoot: root, RAMCacheMaxAge: time.Hour}).srv
	ctx := withCaller(context.Background(), callerA)
	uid := "0b6a4a5e-35c1-4a7c-9f0e-6a2d3c1b9e11"
	pub := csi.Publication{VolumeID: mounter.VolumeHandle(uid, "ram"), Target: "/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi/ram/mount",
		Pod: csi.Pod{Namespace: "tenant-a", Name: "restore", UID: uid}, Image: imgs[0], ReadOnly: true}
	if err := s.CSIPublisher(&fakeMounter{}).Publish(ctx, pub); err != nil {
		t.Fatal(err)
	}
	published, err := s.prepareAndWait(ctx, api.PrepareRequest{Image: imgs[0]})
	if err != nil {
		t.Fatal(err)
	}
	unpublished, err := s.prepareAndWait(ctx, api.PrepareRequest{Image: imgs[1]})
	if err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-2 * time.Hour)
	for _, p := range []string{published.MemoryFile, unpublished.MemoryFile} {
		if err := os.Chtimes(p, old, old); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.prepareAndWait(ctx, api.PrepareRequest{Image: imgs[2]}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(unpublished.MemoryFile); !os.IsNotExist(err) {
		t.Errorf("a file unused for 2h with --ram-cache-max-age 1h is still there (%v)", err)
	}
	if _, err := os.Stat(published.MemoryFile); err != nil {
		t.Errorf("the published file was evicted by age: %v", err)
	}
	// The bytes held are read from the cache at each scrape: the two files
	// left (their data, 1/4 of each) and their device states.
	held := heldBytesOf(t, s, "tenant-a")
	if held < 2*(1<<20)/4 || held > 4<<20 {
		t.Errorf("vmsnap_ram_cache_bytes{namespace=tenant-a} = %v; want the two files' data and states", held)
	}
}

func heldBytesOf(t *testing.T, s *Server, ns string) float64 {
	t.Helper()
	mfs, err := s.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "vmsnap_ram_cache_bytes" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == ns {
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("no vmsnap_ram_cache_bytes for namespace %s", ns)
	return 0
}

package agent

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/agent/csi"
	"github.com/vmsnap/vmsnap/agent/mounter"
	"github.com/vmsnap/vmsnap/internal/testing/csinode"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
)

// publishedFile is the one file a publication's target shows, and its
// inode.
func publishedFile(t *testing.T, v csinode.Volume) (string, uint64) {
	t.Helper()
	des, err := os.ReadDir(v.Target)
	if err != nil || len(des) != 1 || !strings.HasSuffix(des[0].Name(), ".ram") {
		t.Fatalf("the target %s shows %v (%v); want one RAM file", v.Target, des, err)
	}
	p := filepath.Join(v.Target, des[0].Name())
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return p, st.Ino
}

func inode(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		t.Fatalf("%s: %v", p, err)
	}
	return st.Ino
}

// The CSI path end to end without a cluster, on a real registry (TLS,
// htpasswd): a pod's volume gets its namespace's verified cache file,
// read-only; a second pod of that namespace fetches nothing and maps the
// same inode; another namespace gets a file of its own; what the policy
// refuses publishes nothing; a pod cannot change a byte of the file; and
// eviction under pressure spares what a pod's volume shows.
func TestCSIPublish(t *testing.T) {
	reg := registry.Start(t)
	store := []ociimage.Option{ociimage.WithRegistryConfig(reg.ConfigDir), ociimage.WithCAFile(reg.CAFile)}
	img, ram, _ := memoryFileCheckpoint(t, reg.Host+"/vms/csi:a", [3]int{10, 0, 2}, 4<<20, store...)
	stateDir := t.TempDir()
	ta := startAgentConfig(t, Config{StateDir: stateDir, Resolver: newStaticResolver(), AllowRepositories: []string{reg.Host + "/vms"},
		Store: store, RAMCacheMaxBytes: 3 << 19}) // 1.5 MiB: one file of 1 MiB of data and its state, not two
	s := ta.srv
	n := csinode.Start(t, filepath.Join(stateDir, "ram"), func(sock string) csi.Publisher { return s.CSIPublisher(mounter.Client{Socket: sock}) })
	fetched := func(ns string) float64 { return testutil.ToFloat64(s.metrics.cache.fetched.WithLabelValues(ns)) }

	// (a) cold: fetched, and shown read-only.
	v1 := n.NewVolume(t)
	if err := n.Publish(v1, "tenant-a", img); err != nil {
		t.Fatal(err)
	}
	f1, ino1 := publishedFile(t, v1)
	if got, err := os.ReadFile(f1); err != nil || !bytes.Equal(got, ram) {
		t.Fatalf("the published file: %d bytes, %v; want the guest's RAM", len(got), err)
	}
	cacheFile := filepath.Join(RAMCacheDir(stateDir, "tenant-a"), filepath.Base(f1))
	if fetched("tenant-a") == 0 || ino1 != inode(t, cacheFile) {
		t.Errorf("cold publish: fetched %v bytes, inode %d; want a fetch, and tenant-a's cache file (inode %d)", fetched("tenant-a"), ino1, inode(t, cacheFile))
	}
	// (b) warm, and a kubelet retry: nothing fetched, the same inode.
	before := fetched("tenant-a")
	v2 := n.NewVolume(t)
	for range 2 {
		if err := n.Publish(v2, "tenant-a", img); err != nil {
			t.Fatal(err)
		}
	}
	if _, ino2 := publishedFile(t, v2); ino2 != ino1 || fetched("tenant-a") != before {
		t.Errorf("warm publish: inode %d (want %d), fetched %v more bytes (want 0)", ino2, ino1, fetched("tenant-a")-before)
	}
	if hits := testutil.ToFloat64(s.metrics.cache.hits.WithLabelValues("tenant-a")); hits != 2 {
		t.Errorf("tenant-a's cache hits: %v, want 2", hits)
	}
	// (c) another namespace: its own file, fetched again.
	v3 := n.NewVolume(t)
	if err := n.Publish(v3, "tenant-b", img); err != nil {
		t.Fatal(err)
	}
	if _, ino3 := publishedFile(t, v3); ino3 == ino1 || fetched("tenant-b") == 0 {
		t.Errorf("tenant-b's publish: inode %d (tenant-a's is %d), fetched %v; want its own fetched file", ino3, ino1, fetched("tenant-b"))
	}

	attackPublished(t, f1, ram)
	refusedPublishes(t, n, reg, stateDir, store)
	evictionSparesPublished(t, s, n, reg, store, v1, v2, cacheFile)
}

// attackPublished does, as root in the pod, what a hostile QEMU could do to
// the published file, and checks that the file keeps every byte.
func attackPublished(t *testing.T, p string, want []byte) {
	t.Helper()
	for _, flags := range []int{os.O_RDWR, os.O_WRONLY, os.O_RDWR | os.O_TRUNC} {
		if f, err := os.OpenFile(p, flags, 0); !errors.Is(err, syscall.EROFS) {
			if err == nil {
				f.Write([]byte("tampered"))
				f.Close()
			}
			t.Errorf("open with flags %#x: %v; want EROFS", flags, err)
		}
	}
	if err := os.Truncate(p, 4096); !errors.Is(err, syscall.EROFS) {
		t.Errorf("truncate: %v; want EROFS", err)
	}
	if err := os.Chmod(p, 0o666); !errors.Is(err, syscall.EROFS) {
		t.Errorf("chmod: %v; want EROFS", err)
	}
	if err := os.WriteFile(filepath.Join(filepath.Dir(p), "x"), nil, 0o644); !errors.Is(err, syscall.EROFS) {
		t.Errorf("creating a file beside it: %v; want EROFS", err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
		copy(m, "tampered")
		unix.Munmap(m)
		t.Error("a shared writable mapping of a read-only open was allowed")
	}
	m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("a private mapping, as QEMU's: %v", err)
	}
	copy(m, "private write")
	unix.Munmap(m)
	if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, want) {
		t.Errorf("after the attacks the file differs from the guest's RAM (%v)", err)
	}
}

// refusedPublishes: an image outside the allowed repositories, and one a
// QEMU before 8.2 made (not served through a CSI volume yet), publish
// nothing.
func refusedPublishes(t *testing.T, n *csinode.Node, reg *registry.Registry, stateDir string, store []ociimage.Option) {
	t.Helper()
	other, _, _ := memoryFileCheckpoint(t, reg.Host+"/other/csi:a", [3]int{10, 0, 2}, 1<<20, store...)
	old, _, _ := memoryFileCheckpoint(t, reg.Host+"/vms/csi:old", [3]int{}, 1<<20, store...)
	for _, tc := range []struct {
		name, image string
		code        codes.Code
	}{
		{"a repository not allowed", other, codes.PermissionDenied},
		{"an image of QEMU 7.2", old, codes.InvalidArgument},
	} {
		v := n.NewVolume(t)
		err := n.Publish(v, "tenant-a", tc.image)
		if status.Code(err) != tc.code {
			t.Errorf("%s: %v; want %s", tc.name, err, tc.code)
		}
		if _, err := os.Lstat(v.Target); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: the target %s exists (%v): something was published", tc.name, v.Target, err)
		}
		if _, err := os.Lstat(filepath.Join(RAMCacheDir(stateDir, "tenant-a"), "pub", v.ID)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: a publication directory was left (%v)", tc.name, err)
		}
	}
}

// evictionSparesPublished fills tenant-a's cache past its bound while v1
// and v2 show cacheFile: other files go, cacheFile stays until both are
// unpublished.
func evictionSparesPublished(t *testing.T, s *Server, n *csinode.Node, reg *registry.Registry, store []ociimage.Option, v1, v2 csinode.Volume, cacheFile string) {
	t.Helper()
	ctx := withCaller(t.Context(), callerA)
	var files []string
	for _, tag := range []string{"b", "c"} {
		img, _, _ := memoryFileCheckpoint(t, reg.Host+"/vms/csi:"+tag, [3]int{10, 0, 2}, 4<<20, store...)
		res, err := s.prepareAndWait(ctx, api.PrepareRequest{Image: img})
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, res.MemoryFile)
	}
	if _, err := os.Stat(files[0]); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the unpublished file %s was not evicted past the bound (%v)", files[0], err)
	}
	if _, err := os.Stat(cacheFile); err != nil {
		t.Fatalf("the published file was evicted: %v", err)
	}
	// Two: b, and the file of QEMU 7.2's image, which its refused publish
	// filled (refusedPublishes).
	if ev := testutil.ToFloat64(s.metrics.cache.evictions.WithLabelValues("tenant-a")); ev != 2 {
		t.Errorf("tenant-a's evictions: %v, want 2", ev)
	}
	for _, v := range []csinode.Volume{v1, v2} {
		if err := n.Unpublish(v); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Lstat(v.Target); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("after unpublish the target %s is still there (%v)", v.Target, err)
		}
	}
	img, _, _ := memoryFileCheckpoint(t, reg.Host+"/vms/csi:d", [3]int{10, 0, 2}, 4<<20, store...)
	if _, err := s.prepareAndWait(ctx, api.PrepareRequest{Image: img}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(cacheFile); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("once unpublished, the file was not evicted past the bound (%v)", err)
	}
}

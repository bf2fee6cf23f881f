package snapshot

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// PrepareSpec readies the restore of a memory-file image on this node.
type PrepareSpec struct {
	Image    string // REF@sha256:...
	AllowTag bool
	// CacheDir holds the node's RAM files, one per image (ramfile.Cache):
	// one trust domain's (see its doc). Default DefaultCacheDir().
	CacheDir string
	// MaxCacheBytes, if above 0, evicts the least recently used RAM files
	// past it once this one is ready.
	MaxCacheBytes int64
	// QEMUDir is CacheDir as the target QEMU sees it (its container's
	// mount), for the QEMU arguments; default CacheDir.
	QEMUDir string
	// CopyTo gives the VM its own copy of the file in this directory,
	// mapped shared, so that it can be checkpointed as a delta on this
	// image (vmstate.PrepareOptions.CopyTo).
	CopyTo   string
	Workers  int
	Store    []ociimage.Option
	Progress Progress
}

// DefaultCacheDir is where a local prepare keeps RAM files: tmpfs, whose
// pages are memory a QEMU maps directly, in a directory of this user's.
func DefaultCacheDir() string {
	return filepath.Join("/dev/shm", fmt.Sprintf("vmsnap-%d", os.Geteuid()), "ram")
}

// Prepare materializes a memory-file image's RAM file (or finds it in the
// cache) and returns the arguments the target QEMU needs.
func Prepare(ctx context.Context, s PrepareSpec) (*api.PrepareResult, error) {
	if s.Image == "" {
		return nil, errcode.New(errcode.Usage, "prepare needs an image reference (REF@sha256:...)")
	}
	if s.MaxCacheBytes < 0 {
		return nil, errcode.New(errcode.Usage, "maxCacheBytes %d: give a size, or 0 for no bound", s.MaxCacheBytes)
	}
	if s.CacheDir == "" {
		s.CacheDir = DefaultCacheDir()
	}
	repo, err := openPinned(ctx, s.Image, "image", s.AllowTag, s.Store)
	if err != nil {
		return nil, err
	}
	res, err := vmstate.Prepare(ctx, repo, vmstate.PrepareOptions{
		Cache: ramfile.Cache{Dir: s.CacheDir}, MaxCacheBytes: s.MaxCacheBytes, QEMUDir: s.QEMUDir, CopyTo: s.CopyTo,
		Workers: s.Workers, Progress: s.Progress.bytes("prepare"),
	})
	if err != nil {
		return nil, err
	}
	out := &api.PrepareResult{
		Image: repo.Reference().WithDigest(res.Manifest.Digest).String(), Digest: res.Manifest.Digest.String(),
		QEMUArgs: res.QEMUArgs, MemoryFile: res.MemoryFile, FetchedBytes: res.FetchedBytes,
		MemoryBytes: res.Config.RAM.Bytes, DataBytes: res.Config.RAM.DataBytes,
		DurationsMs: map[string]float64{"total": api.Ms(res.Duration), "copy": api.Ms(res.CopyDuration)},
	}
	for _, e := range res.Evicted {
		out.Evicted = append(out.Evicted, string(e.Key))
	}
	return out, nil
}

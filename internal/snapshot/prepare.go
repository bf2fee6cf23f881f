package snapshot

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// PrepareSpec readies the restore of a memory-file image on this node.
type PrepareSpec struct {
	Image    string // REF@sha256:...
	AllowTag bool
	// CacheDir holds the node's RAM files, one per image (ramfile.Cache):
	// one trust domain's (see its doc). Default DefaultCacheDir().
	CacheDir string
	// PrivateParent: the directories above CacheDir are not shared with
	// other users (ramfile.Cache.PrivateParent).
	PrivateParent bool
	// MaxCacheBytes, if above 0, evicts the least recently used RAM files
	// past it once this one is ready.
	MaxCacheBytes int64
	// MaxCacheAge, if above 0, evicts the RAM files unused for longer.
	MaxCacheAge time.Duration
	// QEMUDir is CacheDir as the target QEMU sees it (its container's
	// mount), for the QEMU arguments; default CacheDir.
	QEMUDir string
	// CopyTo gives the VM its own copy of the file in this directory,
	// mapped shared, so that it can be checkpointed as a delta on this
	// image (vmstate.PrepareOptions.CopyTo).
	CopyTo string
	// Records, with CopyTo, records the image as the parent of the VM's
	// next checkpoint (vmstate.ParentRecords; DefaultParentRecordsDir for
	// the CLI).
	Records *vmstate.ParentRecords
	// MaxGuestMemory refuses an image that declares more guest memory,
	// before a layer of it is fetched (0: no bound).
	MaxGuestMemory int64
	Workers        int
	Store          []ociimage.Option
	Progress       Progress
}

// DefaultCacheDir is where a local prepare keeps RAM files: tmpfs, whose
// pages are memory a QEMU maps directly, in a directory of this user's.
func DefaultCacheDir() string {
	return filepath.Join("/dev/shm", fmt.Sprintf("vmsnap-%d", os.Geteuid()), "ram")
}

// DefaultParentRecordsDir is where the CLI keeps, per VM it checkpoints
// in the memory-file format, the checkpoint the VM's next builds on
// (vmstate.ParentRecords): beside the RAM cache, in a directory of this
// user's.
func DefaultParentRecordsDir() string {
	return filepath.Join(filepath.Dir(DefaultCacheDir()), "parents")
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
	repo, cp, err := openPinned(ctx, s.Image, "image", ociimage.PartVMState, s.AllowTag, s.Store)
	if err != nil {
		return nil, err
	}
	res, err := vmstate.Prepare(ctx, repo, vmstate.PrepareOptions{
		Cache: ramfile.Cache{Dir: s.CacheDir, PrivateParent: s.PrivateParent}, MaxCacheBytes: s.MaxCacheBytes, MaxCacheAge: s.MaxCacheAge, QEMUDir: s.QEMUDir, CopyTo: s.CopyTo,
		Records: s.Records, MaxGuestMemory: s.MaxGuestMemory, Workers: s.Workers, Progress: s.Progress.bytes("prepare"),
	})
	if err != nil {
		return nil, err
	}
	out := &api.PrepareResult{
		Image: repo.Reference().WithDigest(res.Manifest.Digest).String(), Digest: res.Manifest.Digest.String(), Checkpoint: checkpointRef(cp),
		QEMUArgs: res.QEMUArgs, MemoryFile: res.MemoryFile, FetchedBytes: res.FetchedBytes,
		MemoryBytes: res.Config.RAM.Bytes, DataBytes: res.Config.RAM.DataBytes, RecordNote: res.RecordNote,
		DurationsMs: map[string]float64{"total": api.Ms(res.Duration), "copy": api.Ms(res.CopyDuration)},
	}
	for _, e := range res.Evicted {
		out.Evicted = append(out.Evicted, string(e.Key))
	}
	return out, nil
}

// PreparedFile is the file, in a directory where Stage put a memory-file
// image's device state, in which `vmsnap prepare --state-dir` records
// what it prepared (an api.PrepareResult), for `vmsnap launch` to start
// QEMU with the arguments that map the RAM file.
const PreparedFile = "prepared.json"

// maxPreparedFile bounds what ReadPrepared reads: the file is in a pod's
// volume.
const maxPreparedFile = 64 << 10

// WritePrepared records res in dir (PreparedFile), atomically.
func WritePrepared(dir string, res *api.PrepareResult) error {
	b, err := json.Marshal(res)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "encoding the prepare result")
	}
	if err := atomicfile.WriteFile(filepath.Join(dir, PreparedFile), append(b, '\n'), 0o644); err != nil {
		return errcode.Wrap(errcode.Internal, err, "writing %s in %s (is %s the writable state volume?)", PreparedFile, dir, errcode.Field("stateDir"))
	}
	return nil
}

// Prepared is what `vmsnap prepare --state-dir` recorded for the image
// staged in a directory, checked (PreparedArgs).
type Prepared struct {
	Digest     digest.Digest
	QEMUArgs   []string // what maps the RAM file
	MemoryFile string   // the RAM file, as QEMU sees it
}

// PreparedArgs returns the QEMU arguments that map the RAM file of the
// memory-file image staged in dir, from what `vmsnap prepare --state-dir`
// recorded there. What was recorded must be for the staged image (same
// manifest digest), name a file of the cache named for that digest, and
// its arguments must be exactly those vmsnap derives from the staged
// image's config for that file: the file is in a pod's volume, and what
// it says becomes QEMU's command line.
func PreparedArgs(ctx context.Context, dir string) (Prepared, error) {
	d, cfg, err := StagedConfig(ctx, dir)
	if err != nil {
		return Prepared{}, err
	}
	if cfg.Format != vmspec.FormatMemoryFile {
		return Prepared{}, errcode.New(errcode.Usage, "the snapshot staged in %s is in the %s format, which needs no prepare", dir, cfg.Format)
	}
	p := filepath.Join(dir, PreparedFile)
	f, err := os.Open(p)
	if err != nil {
		return Prepared{}, errcode.Wrap(errcode.Usage, err,
			"the snapshot staged in %s (%s) is in the memory-file format: its RAM file must be prepared first, with vmsnap prepare %s --cache-dir RAM_DIR --state-dir %s (an init container after the restore's)", dir, d, d, dir)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxPreparedFile+1))
	if err != nil || len(b) > maxPreparedFile {
		return Prepared{}, errcode.New(errcode.InvalidInput, "%s: unreadable or over %d bytes (%v)", p, maxPreparedFile, err)
	}
	var res api.PrepareResult
	if err := json.Unmarshal(b, &res); err != nil {
		return Prepared{}, errcode.Wrap(errcode.InvalidInput, err, "%s is not a prepare result", p)
	}
	if res.Digest != d.String() {
		return Prepared{}, errcode.New(errcode.InvalidInput, "%s is for snapshot %s, but %s is staged: run vmsnap prepare for the staged snapshot", p, clipped(res.Digest), d)
	}
	if ramfile.KeyOf(res.MemoryFile) != d || !filepath.IsAbs(res.MemoryFile) || filepath.Clean(res.MemoryFile) != res.MemoryFile {
		return Prepared{}, errcode.New(errcode.InvalidInput, "%s names the RAM file %q, which is not the file prepared for %s", p, clipped(res.MemoryFile), d)
	}
	// A VM's own copy (prepare --copy-to) is mapped shared, a cache file
	// private: the name says which, and the arguments must agree.
	want := vmstate.QEMUArgs(cfg, res.MemoryFile, ramfile.IsOwnCopy(res.MemoryFile))
	if !slices.Equal(res.QEMUArgs, want) {
		return Prepared{}, errcode.New(errcode.InvalidInput, "%s has QEMU arguments %q, not those of the staged snapshot's RAM file (%q): run vmsnap prepare again", p, res.QEMUArgs, want)
	}
	fi, err := os.Stat(res.MemoryFile)
	if err != nil || !fi.Mode().IsRegular() || fi.Size() != cfg.RAM.Bytes {
		return Prepared{}, errcode.New(errcode.InvalidInput, "the prepared RAM file %s is not there as a file of %d bytes (%v): is its volume mounted at the same path in this container, and was it emptied (a node reboot empties medium: Memory)?", res.MemoryFile, cfg.RAM.Bytes, err)
	}
	return Prepared{Digest: d, QEMUArgs: want, MemoryFile: res.MemoryFile}, nil
}

func clipped(s string) string {
	if len(s) > 100 {
		return s[:100] + "..."
	}
	return s
}

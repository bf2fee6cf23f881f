package vmstate

import (
	"context"
	"fmt"
	"os"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// checkGuestMemory refuses an image that declares more guest memory than
// max (0: no bound), before any of its layers is fetched: what a prepare
// holds and writes is bounded by what the image stores, and this bounds
// what it may claim.
func checkGuestMemory(cfg Config, max int64) error {
	if max > 0 && (cfg.Record.MemoryBytes > max || (cfg.RAM != nil && cfg.RAM.Bytes > max)) {
		return errcode.New(errcode.InvalidInput, "the image declares %d MiB of guest memory, more than this node takes (%s, %d MiB): raise it if the image is one you expect", cfg.Record.MemoryBytes>>20, errcode.Field("maxGuestMemory"), max>>20)
	}
	return nil
}

// maxFillBytes is the most a prepare's RAM file may allocate: what the
// config declares, and a region's worth of rounding (a filesystem
// allocates whole blocks). The fill reserves it and Materialize holds the
// file to it.
func maxFillBytes(cfg Config) int64 { return cfg.RAM.DataBytes + ramfile.RegionSize }

// materializeVerified writes the image's RAM file into f, then, for a
// delta, checks every page of it against the image's page map
// (ramfile.Verify) before any QEMU may map it: a delta's inherited pages
// were taken on its parent's word at checkpoint, and a parent whose layers
// do not hold what its map says is refused here (DIGEST_MISMATCH). A
// base's pages are all its own layers', verified by their digests: its map
// decides nothing a restore gives (a VM's own copy is checked against it
// all the same before the node records it, recordOwnCopy). An image in the
// pack format needs no second pass: Materialize checked every region
// against its hash in the index, which the checkpoint computed from the
// same map.
func materializeVerified(ctx context.Context, repo ociimage.Repository, cfg Config, ram ramfile.Layers, f *os.File, opts PrepareOptions) (int64, error) {
	mo := ramfile.MaterializeOptions{Workers: opts.Workers, Progress: opts.Progress, MaxDataBytes: maxFillBytes(cfg)}
	fetched, err := ramfile.Materialize(ctx, ram, repo, f, cfg.RAM.Bytes, mo)
	if err != nil || len(cfg.RAM.Chain) == 1 || ram.Index != nil {
		return fetched, err
	}
	_, err = ramfile.Verify(ctx, ram, repo, f, cfg.RAM.Bytes, false)
	return fetched, err
}

// recordOwnCopy records the image as the parent of the next checkpoint of
// the VM that will map its own copy at path (ParentRecords), once the copy
// verified page by page against the image's map: the recorded map is the
// copy's. A copy that does not verify is an error; a record that cannot be
// written, a note.
func recordOwnCopy(ctx context.Context, repo ociimage.Repository, image ocispec.Descriptor, cfg Config, ram ramfile.Layers, path string, records *ParentRecords) (string, error) {
	if records == nil || records.Dir == "" {
		return "no parent records directory: the VM's next checkpoint is a base", nil
	}
	f, err := os.Open(path)
	if err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "reading the VM's own RAM file")
	}
	defer f.Close()
	m, err := ramfile.Verify(ctx, ram, repo, f, cfg.RAM.Bytes, true)
	if err != nil {
		return "", errcode.Wrap(errcode.Of(err), err, "the VM's own copy of the cached RAM file is not the image's (was the cache file changed?)")
	}
	be := &RAMBackend{ID: cfg.RAM.Backend, Bytes: cfg.RAM.Bytes, MemPath: path}
	if err := records.save(f, be, repo, image, m); err != nil {
		return fmt.Sprintf("the VM's own copy could not be recorded as its next checkpoint's parent (%v): that checkpoint is a base", err), nil
	}
	return "", nil
}

// DefaultMaxGuestMemory is the guest memory a node takes by default: its
// own memory (a guest that declares more could not run here anyway), or
// 1 TiB where the kernel does not say.
func DefaultMaxGuestMemory() int64 {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil || si.Totalram == 0 {
		return ramfile.MaxRAMBytes
	}
	return int64(si.Totalram) * int64(si.Unit)
}

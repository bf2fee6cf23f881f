package vmstate

import (
	"context"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// The memory-file format is for a VM whose RAM is a shared file
// (-object memory-backend-file,id=ID,mem-path=FILE,share=on,size=SIZE
// -machine memory-backend=ID). With QEMU's x-ignore-shared capability a
// migration carries only the device state, and vmsnap reads the guest's
// RAM from FILE itself:
//
//   - checkpoint: the VM is stopped, QEMU streams its device state into
//     chunks, vmsnap hashes every page of FILE and copies the pages that
//     changed since the parent checkpoint aside (package ramfile), and the
//     VM runs again; only then are the pages compressed and stored, as a
//     delta on top of the parent's layers (or a base: no parent, a parent
//     of another VM, or a chain past its bound);
//   - restore: Prepare materializes FILE into a node-local cache, once per
//     image, and gives the QEMU arguments that map it private
//     (share=off): the guest's pages fault in from the file as it touches
//     them, and writes stay in the VM. Restore then loads the device
//     state, which takes milliseconds whatever the guest's size.

const (
	capIgnoreShared = "x-ignore-shared"
	// DefaultMaxChain is how many deltas a chain holds before the next
	// checkpoint is a fresh base: every delta adds its layers to what a
	// cold restore fetches and writes, a base resets that.
	DefaultMaxChain = 8
	maxChainLinks   = 256
)

// RAMBackend is the memory backend that holds the machine's RAM, when the
// machine names one (-machine memory-backend=ID). Migration finds its
// pages by ID, so source and target must use the same.
type RAMBackend struct {
	ID       string `json:"id"`
	Type     string `json:"type"` // QOM type: memory-backend-file, -ram, -memfd
	Bytes    int64  `json:"bytes"`
	Share    bool   `json:"share"`
	ReadOnly bool   `json:"readOnly,omitempty"`
	// MemPath is a file backend's mem-path, as QEMU sees it. Not recorded:
	// it names a file of one node.
	MemPath string `json:"-"`
	// OtherShared lists the VM's other shared memory backends (ivshmem, a
	// DAX window): x-ignore-shared leaves them out of a migration too,
	// which a pre-copy cannot rewrite its stream to match.
	OtherShared []string `json:"-"`
}

// fileShared says whether the backend is a shared file vmsnap can read the
// guest's RAM from.
func (b *RAMBackend) fileShared() bool {
	return b != nil && b.Type == "memory-backend-file" && b.Share && b.MemPath != ""
}

// readRAMBackend asks QEMU for the machine's memory backend. A machine
// without one (plain -m) gives nil.
func readRAMBackend(ctx context.Context, mon Executor) (*RAMBackend, error) {
	var name string
	if err := mon.Execute(ctx, "qom-get", map[string]string{"path": "/machine", "property": "memory-backend"}, &name); err != nil || name == "" {
		return nil, nil // QEMU before 5.0, or no backend named
	}
	id := strings.TrimPrefix(name, "/objects/")
	if !validBackendID(id) {
		return nil, errcode.New(errcode.QMPError, "QEMU names the machine's memory backend %q, which is not an object vmsnap can read", name)
	}
	qomPath := "/objects/" + id
	b := &RAMBackend{ID: id}
	if err := mon.Execute(ctx, "qom-get", map[string]string{"path": qomPath, "property": "type"}, &b.Type); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "reading the type of memory backend %s", id)
	}
	var devs []struct {
		ID    string `json:"id"`
		Size  int64  `json:"size"`
		Share bool   `json:"share"`
	}
	if err := mon.Execute(ctx, "query-memdev", nil, &devs); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "query-memdev")
	}
	found := false
	for _, d := range devs {
		switch {
		case d.ID == id:
			b.Bytes, b.Share, found = d.Size, d.Share, true
		case d.Share:
			b.OtherShared = append(b.OtherShared, d.ID)
		}
	}
	if !found {
		return nil, errcode.New(errcode.QMPError, "QEMU's query-memdev does not list the machine's memory backend %s", id)
	}
	if b.Type == "memory-backend-file" {
		if err := mon.Execute(ctx, "qom-get", map[string]string{"path": qomPath, "property": "mem-path"}, &b.MemPath); err != nil {
			return nil, errcode.Ensure(errcode.QMPError, err, "reading the mem-path of memory backend %s", id)
		}
		_ = mon.Execute(ctx, "qom-get", map[string]string{"path": qomPath, "property": "readonly"}, &b.ReadOnly)
	}
	return b, nil
}

// RAMConfig is, in a memory-file image's config, what its RAM file is.
type RAMConfig struct {
	Backend string `json:"backend"` // the memory backend's ID
	Bytes   int64  `json:"bytes"`   // the file's size, the guest's RAM
	// DataBytes is the file's non-zero pages: what a materialized file
	// allocates.
	DataBytes int64 `json:"dataBytes"`
	// Chain is the checkpoints whose region layers the image's make up,
	// its base first and itself last (with no manifest: it has none yet).
	Chain []ChainLink `json:"chain"`
}

// ChainLink is one checkpoint of a chain.
type ChainLink struct {
	Manifest     digest.Digest `json:"manifest,omitempty"`
	Created      time.Time     `json:"created"`
	Regions      int           `json:"regions"`         // regions it stored (region layers, or frames in its packs)
	Packs        int           `json:"packs,omitempty"` // packs it added (the pack format)
	StoredBytes  int64         `json:"storedBytes"`     // their compressed bytes
	ChangedPages int           `json:"changedPages"`    // pages it stored
}

// Parent is the manifest digest of the checkpoint this image is a delta
// on, or "" for a base.
func (c *RAMConfig) Parent() digest.Digest {
	if c == nil || len(c.Chain) < 2 {
		return ""
	}
	return c.Chain[len(c.Chain)-2].Manifest
}

// check validates a memory-file config against its manifest's layers.
func (c Config) checkRAM(layers []ocispec.Descriptor) (stream []ocispec.Descriptor, ram ramfile.Layers, err error) {
	if c.Format != FormatMemoryFile {
		return layers, ram, nil
	}
	// Encrypted layers read without a key that opens them (AUTH_FAILED).
	if err := imgcrypt.CheckDecrypted(layers); err != nil {
		return nil, ram, err
	}
	if c.RAM == nil || c.RAM.Backend == "" || len(c.RAM.Chain) == 0 || len(c.RAM.Chain) > maxChainLinks {
		return nil, ram, errcode.New(errcode.InvalidInput, "the image is in the memory-file format but its config does not describe the RAM file and its chain")
	}
	if c.RAM.Bytes != c.Record.MemoryBytes {
		return nil, ram, errcode.New(errcode.InvalidInput, "the image's RAM file is %d bytes, its VM has %d bytes of memory", c.RAM.Bytes, c.Record.MemoryBytes)
	}
	if !validBackendID(c.RAM.Backend) || c.Record.RAM == nil || c.Record.RAM.ID != c.RAM.Backend {
		return nil, ram, errcode.New(errcode.InvalidInput, "the image's RAM file belongs to memory backend %q, which its compatibility record does not name (or which is not a QEMU id)", c.RAM.Backend)
	}
	var ramLayers []ocispec.Descriptor
	for _, l := range layers {
		if ramfile.IsRAMLayer(l) {
			ramLayers = append(ramLayers, l)
		} else {
			stream = append(stream, l)
		}
	}
	if ram, err = ramfile.SplitLayers(ramLayers, c.RAM.Bytes); err != nil {
		return nil, ram, err
	}
	return stream, ram, c.RAM.checkChain(ram)
}

func (c Config) formatName() string {
	if c.Format == "" {
		return string(FormatStream)
	}
	return string(c.Format)
}

func (o CheckpointOptions) maxChain() int {
	if o.MaxChain <= 0 {
		return DefaultMaxChain
	}
	return min(o.MaxChain, MaxChain)
}

// MaxChain is the most deltas a chain may hold (a config lists at most
// maxChainLinks checkpoints).
const MaxChain = maxChainLinks - 1

// checkpointMemoryFile is Checkpoint's memory-file path, for a VM whose
// RAM is a shared memory-backend-file.
func (r *checkpointRun) checkpointMemoryFile(ctx context.Context) (out *CheckpointResult, err error) {
	res, opts := r.res, r.opts
	be := res.Config.Record.RAM
	res.Config.Format = FormatMemoryFile
	if be.Bytes != res.Config.Record.MemoryBytes {
		return nil, errcode.New(errcode.Usage, "the memory backend %s holds %d MiB but the VM has %d MiB of memory (hotplugged memory?): use %s stream", be.ID, be.Bytes>>20, res.Config.Record.MemoryBytes>>20, errcode.Field("format"))
	}
	f, err := openCheckpointRAMFile(ctx, r.mon, opts, be)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	// What it stages (pages, device state) is bounded by the VM's memory:
	// that room is reserved until the staging files are gone.
	release, err := reserveStaging(stagingDir(opts.StagingDir), maxStateBytes(res.Config.Record.MemoryBytes), false, opts.StagingOwner)
	if err != nil {
		return nil, err
	}
	defer release()
	c := &memFileCheckpoint{checkpointRun: r, be: be, f: f}
	if err := c.findParent(ctx); err != nil {
		return nil, err
	}

	// No stoppedMemory: with x-ignore-shared QEMU sends only its few
	// unshared pages (ROMs) and the devices, and the VM is stopped
	// throughout (memory-file is never live). The one-final-pass settings
	// (a bandwidth of memory/1000) made QEMU send a slice of those pages,
	// then wait out its first 100 ms bandwidth window before completing:
	// 100 ms of the guest's downtime. At full bandwidth it sends them in its
	// first iteration and completes at once.
	g, err := r.guard(ctx, migrationSettings{source: true, ignoreShared: true})
	defer g.finish(&out, &err)
	if err != nil {
		return nil, err
	}
	defer c.close()
	if err := c.tryPrecopy(ctx); err != nil {
		return nil, err
	}
	if c.pre == nil {
		if c.devices, err = r.newStreamCapture(ctx); err != nil {
			return nil, err
		}
	}
	if err = r.stopAndSave(ctx, c); err != nil {
		return nil, err
	}
	// Committed: the VM's next checkpoint builds on this one.
	if err := opts.Records.save(f, be, r.repo, res.Manifest, c.recorded); err != nil {
		res.RAMRecordNote = fmt.Sprintf("this checkpoint could not be recorded as the VM's next parent (%v): the next is a base", err)
	}
	return res, nil
}

func layerBytes(ls []ocispec.Descriptor) (n int64) {
	for _, l := range ls {
		n += l.Size
	}
	return n
}

// PrepareOptions tunes Prepare.
type PrepareOptions struct {
	Cache ramfile.Cache
	// MaxCacheBytes, if set, evicts the least recently used files past
	// it once the file is ready.
	MaxCacheBytes int64
	// MaxCacheAge, if set, evicts the files unused for longer, with the
	// size bound (the file just prepared and published files stay).
	MaxCacheAge time.Duration
	// QEMUDir is the cache directory as the target QEMU sees it (a
	// container's mount of it), for QEMUArgs; default Cache.Dir.
	QEMUDir string
	// CopyTo, if set, is a directory where the VM gets its own copy of the
	// file, which it maps shared (share=on): its RAM is then a shared file
	// again, so that it can be checkpointed as a delta on this image. It
	// costs a copy of the image's data; the copy is the caller's to remove.
	CopyTo string
	// Records, with CopyTo, is where the node records the image as the
	// parent of the VM's next checkpoint, by its own copy's identity
	// (ParentRecords): the copy is verified page by page against the
	// image's map first.
	Records *ParentRecords
	// MaxGuestMemory, if above 0, refuses an image that declares more
	// guest memory, before any of its layers is fetched.
	MaxGuestMemory int64
	Workers        int
	Progress       func(fetched int64)
}

// PrepareResult is what Prepare made ready.
type PrepareResult struct {
	Manifest     ocispec.Descriptor
	Config       Config
	MemoryFile   string   // the materialized RAM file
	QEMUArgs     []string // what the target QEMU adds to its arguments
	FetchedBytes int64    // compressed bytes fetched: 0 if the cache had it
	Evicted      []ramfile.Entry
	Duration     time.Duration
	CopyDuration time.Duration // of the VM's own copy (CopyTo)
	// RecordNote says why the VM's own copy was not recorded as its next
	// checkpoint's parent, if it was not (its next checkpoint is a base).
	RecordNote string
}

// Prepare readies a restore of a memory-file image on this node: it
// materializes the image's RAM file into the cache (or finds it there),
// verifying every region before it is written, and returns the arguments
// the target QEMU needs to map it. The target starts with those and
// -incoming defer; Restore then loads the device state.
func Prepare(ctx context.Context, repo ociimage.Repository, opts PrepareOptions) (*PrepareResult, error) {
	start := time.Now()
	desc, m, cfg, err := LoadConfig(ctx, repo)
	if err != nil {
		return nil, err
	}
	if cfg.Format != FormatMemoryFile {
		return nil, errcode.New(errcode.Usage, "%s holds its state in the %s format, which QEMU loads from the stream: it needs no prepare (restore it into a QEMU started with -incoming defer)", repo.Reference(), cfg.formatName())
	}
	if err := checkGuestMemory(cfg, opts.MaxGuestMemory); err != nil {
		return nil, err
	}
	_, ram, err := cfg.checkRAM(m.Layers)
	if err != nil {
		return nil, err
	}
	res := &PrepareResult{Manifest: desc, Config: cfg}
	if cfg.RAM.DataBytes < 0 || cfg.RAM.DataBytes > cfg.RAM.Bytes {
		return nil, errcode.New(errcode.InvalidInput, "the image declares %d bytes of data in a %d-byte RAM file", cfg.RAM.DataBytes, cfg.RAM.Bytes)
	}
	if opts.MaxCacheBytes > 0 && cfg.RAM.DataBytes > opts.MaxCacheBytes {
		return nil, errcode.New(errcode.Usage, "the image's RAM file holds %d MiB of data, more than the cache may hold (%d MiB)", cfg.RAM.DataBytes>>20, opts.MaxCacheBytes>>20)
	}
	opts.Cache.ReadOnly = mapsReadOnly(cfg)
	res.MemoryFile, res.FetchedBytes, err = opts.Cache.Fill(ctx, desc.Digest, cfg.RAM.Bytes, func(f *os.File) (int64, error) {
		release, err := reserveCache(opts.Cache.Dir, maxFillBytes(cfg))
		if err != nil {
			return 0, err
		}
		defer release()
		return materializeVerified(ctx, repo, cfg, ram, f, opts)
	})
	if err != nil {
		return nil, err
	}
	// Best effort: without it, a restore reads the registry.
	_ = opts.Cache.KeepState(ctx, ociimage.Pinned(repo, desc), desc)
	if res.Evicted, err = opts.Cache.Evict(opts.MaxCacheBytes, opts.MaxCacheAge, desc.Digest); err != nil {
		return nil, err
	}
	dir := opts.QEMUDir
	if dir == "" {
		dir = opts.Cache.Dir
	}
	shared := false
	if opts.CopyTo != "" {
		copyStart := time.Now()
		if res.MemoryFile, err = opts.Cache.CopyFor(desc.Digest, cfg.RAM.Bytes, opts.CopyTo); err != nil {
			return nil, err
		}
		res.CopyDuration = time.Since(copyStart)
		dir, shared = opts.CopyTo, true
		if res.RecordNote, err = recordOwnCopy(ctx, repo, desc, cfg, ram, res.MemoryFile, opts.Records); err != nil {
			os.Remove(res.MemoryFile)
			return nil, err
		}
	}
	res.QEMUArgs = QEMUArgs(cfg, path.Join(dir, path.Base(res.MemoryFile)), shared)
	res.Duration = time.Since(start)
	return res, nil
}

// QEMUArgs are the arguments that map a memory-file image's RAM file at
// memPath. A cache file is mapped private (shared false): the guest's
// writes stay in the VM, the file is never written. QEMU 8.2 and later
// open it read-only too (readonly=on,rom=off); before 8.2, readonly=on
// would make the guest's RAM read-only, so QEMU opens the file read-write
// (see ramfile.Cache on what that allows). A target may be newer than the
// source, never older, so the source's version decides. A VM's own copy
// is mapped shared, as its source's file was.
func QEMUArgs(cfg Config, memPath string, shared bool) []string {
	opts := []string{
		"memory-backend-file",
		"id=" + qemuOptEscape(cfg.RAM.Backend),
		"mem-path=" + qemuOptEscape(memPath),
		"size=" + strconv.FormatInt(cfg.RAM.Bytes, 10),
	}
	switch {
	case shared:
		opts = append(opts, "share=on")
	case mapsReadOnly(cfg):
		opts = append(opts, "share=off", "readonly=on", "rom=off")
	default:
		opts = append(opts, "share=off")
	}
	return []string{"-object", strings.Join(opts, ","), "-machine", "memory-backend=" + qemuOptEscape(cfg.RAM.Backend)}
}

// validBackendID is QEMU's grammar of object ids: a letter, then letters,
// digits, '-', '.' and '_'. An id from an image goes into QEMU's arguments.
func validBackendID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for i, r := range id {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z':
		case i > 0 && (r >= '0' && r <= '9' || r == '-' || r == '.' || r == '_'):
		default:
			return false
		}
	}
	return true
}

// mapsReadOnly says whether a target of this image opens its RAM file
// read-only: QEMU 8.2 and later (readonly=on,rom=off keeps the guest's RAM
// writable); a target is never older than the source.
func mapsReadOnly(cfg Config) bool {
	return cmpVersion(majorMinor(cfg.Record.QEMUVersion), "8.2") >= 0
}

// qemuOptEscape doubles commas, QEMU's escape within an option value.
func qemuOptEscape(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// checkMemoryFileTarget is checkRestorable's part for a memory-file
// image: the target must map a file named for this image, private unless
// it is a VM's own copy, under the same backend ID, and have
// x-ignore-shared. What QEMU reports is compared, never opened: prepared,
// if set, is the file Prepare made in the caller's cache, and a target
// that maps it shared (under any name: a link) is refused.
func checkMemoryFileTarget(ctx context.Context, mon Executor, cfg Config, manifest digest.Digest, target Record, prepared *os.File) ([]string, error) {
	var diffs []string
	caps, err := migrationCapabilities(ctx, mon)
	if err != nil {
		return nil, err
	}
	if _, ok := caps[capIgnoreShared]; !ok {
		diffs = append(diffs, fmt.Sprintf("migration format: snapshot is %s, target QEMU %s lacks the x-ignore-shared capability (QEMU 4.0 or later)", FormatMemoryFile, target.QEMUVersion))
	}
	want := fmt.Sprintf("start it with the arguments vmsnap prepare printed for this image (%s)", strings.Join(QEMUArgs(cfg, ramfile.Cache{}.Path(manifest), false), " "))
	b := target.RAM
	switch {
	case b == nil || b.Type != "memory-backend-file":
		diffs = append(diffs, "memory backend: snapshot's RAM is a file, the target's is not one: "+want)
	case b.ID != cfg.RAM.Backend:
		diffs = append(diffs, fmt.Sprintf("memory backend: snapshot's RAM file is backend %s, the target's is %s", cfg.RAM.Backend, b.ID))
	case ramfile.KeyOf(b.MemPath) != manifest:
		diffs = append(diffs, fmt.Sprintf("memory backend: the target maps %s, not the RAM file of this image: %s", b.MemPath, want))
	case b.Share && !ramfile.IsOwnCopy(b.MemPath) || mapsShared(mon, prepared):
		diffs = append(diffs, "memory backend: the target maps the cached RAM file shared (share=on), so the guest would write into the file every restore of this image uses: map it with share=off, or give the VM its own copy (vmsnap prepare --copy-to DIR)")
	case b.Bytes != cfg.RAM.Bytes:
		diffs = append(diffs, fmt.Sprintf("memory backend: snapshot's RAM file is %d bytes, target's backend %d", cfg.RAM.Bytes, b.Bytes))
	}
	return diffs, nil
}

package vmstate

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"runtime"
	"strings"
	"syscall"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// QEMU 9.0 and later can save a stopped VM in its mapped-ram format: a
// normal migration stream whose RAM section gives every RAMBlock a bitmap
// and a region of its own, each page at a fixed offset of a seekable file
// (zero pages are left as holes), written by several multifd threads at
// once. vmsnap uses it where it can (Format, CheckpointOptions.Format):
//
//   - checkpoint: QEMU writes the state into a sparse staging file; in
//     snapshot mode the VM runs again as soon as QEMU is done, and the file
//     is then cut into chunks at fixed offsets (StreamOptions.Fixed), so
//     that a chunk of an unchanged region has the same digest as in the
//     previous checkpoint, and stored like a stream's chunks;
//   - restore: every chunk is fetched and verified into a sparse staging
//     file (zero pages are not written), and only then is QEMU told to load
//     it, with the same capabilities.
//
// QEMU gets both files as descriptors (add-fd over SCM_RIGHTS, then the URI
// file:/dev/fdset/N), never as paths: it may run in another container. The
// staging files are unlinked as soon as they are open, so that nothing is
// left behind, even if vmsnap is killed, and truncated through vmsnap's own
// descriptor once QEMU is done with them, since QEMU may keep its copy open
// (stagingFile.free).

// capMappedRAM and capMultifd are QEMU's names of the migration capabilities.
const (
	capMappedRAM = "mapped-ram"
	capMultifd   = "multifd"
)

// migrationCapabilities lists the migration capabilities QEMU has, with
// their current state.
func migrationCapabilities(ctx context.Context, mon Executor) (map[string]bool, error) {
	var caps []struct {
		Capability string `json:"capability"`
		State      bool   `json:"state"`
	}
	if err := mon.Execute(ctx, "query-migrate-capabilities", nil, &caps); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "query-migrate-capabilities")
	}
	out := make(map[string]bool, len(caps))
	for _, c := range caps {
		out[c.Capability] = c.State
	}
	return out, nil
}

// chooseFormat decides how a checkpoint captures the VM: the format asked
// for, or for auto, mapped-ram when the QEMU has it (9.0 or later), the
// mode stops the VM and the staging directory has room for the worst case
// (every page of memory written). A stream asked for, and live mode, cost
// no QMP command.
func chooseFormat(ctx context.Context, mon Executor, opts CheckpointOptions, record Record) (Format, error) {
	explicit := false
	switch opts.Format {
	case "", FormatAuto:
		// A shared RAM file is read by vmsnap whatever the QEMU: the
		// device state alone goes through QEMU's stream. Its pages are
		// staged: with no room for the most this VM may stage, the stream.
		if opts.Mode != ModeLive && record.RAM.fileShared() && record.RAM.Bytes <= ramfile.MaxFileBytes &&
			stagingRoom(stagingDir(opts.StagingDir), maxStateBytes(record.MemoryBytes), false, opts.StagingOwner) == nil {
			return FormatMemoryFile, nil
		}
	case FormatStream:
		return FormatStream, nil
	case FormatMemoryFile:
		switch {
		case opts.Mode == ModeLive:
			return "", errcode.New(errcode.Usage, "the memory-file format reads the RAM file of a stopped VM: live mode keeps the VM running and needs the stream format (use %s auto or stream)", errcode.Field("format"))
		case !record.RAM.fileShared():
			return "", errcode.New(errcode.Usage, "the memory-file format needs the VM's RAM in a shared file, and this VM's is not one: start QEMU with -object memory-backend-file,id=ram0,mem-path=FILE,share=on,size=SIZE -machine memory-backend=ram0 (FILE on tmpfs or hugetlbfs), or use %s auto or stream", errcode.Field("format"))
		case record.RAM.Bytes > ramfile.MaxFileBytes:
			return "", errcode.New(errcode.Usage, "the memory-file format holds guests of up to %d GiB (an image lists at most %d regions of %d MiB), and this one has %d GiB: use %s auto or stream", ramfile.MaxFileBytes>>30, ramfile.MaxRegionLayers, ramfile.RegionSize>>20, record.RAM.Bytes>>30, errcode.Field("format"))
		}
		if err := stagingRoom(stagingDir(opts.StagingDir), maxStateBytes(record.MemoryBytes), false, opts.StagingOwner); err != nil {
			return "", err
		}
		return FormatMemoryFile, nil
	case FormatMappedRAM:
		if opts.Mode == ModeLive {
			return "", errcode.New(errcode.Usage, "the mapped-ram format captures a stopped VM: live mode keeps the VM running and needs the stream format (use %s auto or stream)", errcode.Field("format"))
		}
		explicit = true
	default:
		return "", errcode.New(errcode.Usage, "unknown state format %q: use auto, stream, mapped-ram or memory-file", opts.Format)
	}
	// auto picks mapped-ram for snapshot mode only, where it wins: the VM
	// runs again once QEMU has written the file, before the upload. In
	// pause mode the VM stays stopped anyway, and the stream, which
	// compresses while QEMU saves, is as fast to take and faster to
	// restore (measured on QEMU 10, see docs/performance.md).
	if opts.Mode == ModeLive || (!explicit && opts.Mode != ModeSnapshot) {
		return FormatStream, nil
	}
	caps, err := migrationCapabilities(ctx, mon)
	if err != nil {
		return "", err
	}
	if _, ok := caps[capMappedRAM]; !ok {
		if explicit {
			return "", errcode.New(errcode.Usage, "the mapped-ram format needs QEMU 9.0 or later, and this QEMU (%s) lacks the mapped-ram migration capability: use %s auto or stream", record.QEMUVersion, errcode.Field("format"))
		}
		return FormatStream, nil
	}
	err = stagingRoom(stagingDir(opts.StagingDir), maxStateBytes(record.MemoryBytes), true, opts.StagingOwner)
	switch {
	case err == nil:
		return FormatMappedRAM, nil
	case !explicit:
		return FormatStream, nil // the stream needs no staging space
	}
	return "", err
}

// stagingDir is where the mapped-ram file is staged: dir, else $TMPDIR.
func stagingDir(dir string) string {
	if dir == "" {
		return os.TempDir()
	}
	return dir
}

// multifdChannels is how many threads QEMU writes the mapped-ram file with.
func multifdChannels() int64 { return int64(min(max(runtime.NumCPU(), 2), 8)) }

// checkpointMappedRAM is Checkpoint's mapped-ram path: from Checkpoint,
// which has checked the VM's run state (st), read its record into
// res.Config, and sized the chunks.
func checkpointMappedRAM(ctx context.Context, mon Monitor, repo ociimage.Repository, opts CheckpointOptions, st runState, res *CheckpointResult, start time.Time) (out *CheckpointResult, err error) {
	wasRunning := st.Running
	res.Config.Format = FormatMappedRAM
	dir := stagingDir(opts.StagingDir)

	g, err := guardSource(ctx, mon, wasRunning, migrationSettings{source: true, mappedRAM: true})
	defer g.finish(&out, &err)
	if err != nil {
		return nil, err
	}

	sub := mon.Subscribe()
	defer sub.Close()

	// From the file's creation on, it must not hold more than the VM's
	// memory explains: past that, its guard empties it and cancels ctx
	// with its error, which the checkpoint returns.
	memory := res.Config.Record.MemoryBytes
	ctx, abort := context.WithCancelCause(ctx)
	defer abort(nil)
	staging, err := newStagingFile(dir, os.O_WRONLY, mon, memory, opts.StagingOwner, abort)
	if err != nil {
		return nil, err
	}
	// On failure, once the guard has cancelled the migration: the file is
	// emptied and kept so (the checkpoint fails anyway).
	g.onFinish(func() { _ = staging.settle(ctx, true) })
	defer func() {
		if werr := staging.exceeded(); werr != nil {
			err = werr
		}
	}()
	if err = staging.pass(ctx); err != nil {
		return nil, err
	}
	var size, allocated int64
	save := func(ctx context.Context) error {
		g.phase = "saving the VM state into the staging file"
		saveStart := time.Now()
		if err := migrateIntoStaging(ctx, mon, g, sub, staging); err != nil {
			return err
		}
		if err := waitFinalized(ctx, mon); err != nil {
			return err
		}
		res.Durations.Save = time.Since(saveStart)
		var err error
		size, allocated, err = checkExtent(staging.file(), memory)
		if errcode.Of(err) == errcode.QMPError {
			return err
		} else if err != nil {
			return stagingError(dir, err, "reading the staging file")
		}
		if size == 0 {
			return errcode.New(errcode.QMPError, "QEMU reported the migration complete but wrote no state")
		}
		return nil
	}
	// The state is in the file: the VM need not wait for the upload.
	// QEMU 9.0 keeps its descriptor while the VM is stopped; any QEMU
	// closes it at remove-fd while the VM runs.
	mayKeep := keepsRemovedFDs(res.Config.Record.QEMUVersion) && !(opts.Mode == ModeSnapshot && wasRunning)
	store := func(ctx context.Context) error {
		// QEMU is done with the file.
		staging.dropFDSet(ctx)
		g.phase = "storing the VM state"
		streamStart := time.Now()
		so := opts.Stream
		so.Fixed = true
		var err error
		res.Stream, err = chunk.EncodeStream(ctx, &sparseReader{f: staging.file(), size: size}, repo, so)
		if err != nil {
			return err
		}
		if res.Stream.RawBytes != size {
			return errcode.New(errcode.Internal, "read %d bytes of the %d-byte staging file", res.Stream.RawBytes, size)
		}
		res.Durations.Stream = res.Durations.Save + time.Since(streamStart)
		res.Config.RawBytes = size
		res.Config.DataBytes = allocated
		if err = staging.exceeded(); err != nil {
			return err
		}
		// Before the tag: a QEMU that still writes into the file fails it.
		return staging.settle(ctx, mayKeep)
	}
	if err = stopAndSave(ctx, mon, g, repo, opts, res, start, save, store); err != nil {
		return nil, err
	}
	return res, nil
}

// migrateIntoStaging has QEMU migrate the VM's state into the staging
// file and waits for the migration to complete. A QEMU that ran out of
// room says so only in its error's text: that becomes the staging file's
// error, which tells what to do.
func migrateIntoStaging(ctx context.Context, mon Monitor, g *sourceGuard, sub *qmp.Subscription, staging *stagingFile) error {
	g.migrating = true // set before asking: if the reply is lost, the migration may still run
	if err := mon.Execute(ctx, "migrate", map[string]any{"uri": staging.uri()}, nil); err != nil {
		return errcode.Ensure(errcode.QMPError, err, "starting the migration into the staging file")
	}
	if _, err := waitMigration(ctx, mon, sub, nil); err != nil {
		switch desc := err.Error(); {
		case strings.Contains(desc, "No space left"):
			err = staging.qemuFull(syscall.ENOSPC)
		case strings.Contains(desc, "quota exceeded"):
			err = staging.qemuFull(syscall.EDQUOT)
		}
		return err
	}
	g.migrating = false
	return nil
}

// waitFinalized waits until QEMU has left the finish-migrate run state: it
// sends the MIGRATION "completed" event a moment before, and refuses cont
// ("Migration is not finalized yet") until then.
func waitFinalized(ctx context.Context, mon Executor) error {
	for {
		st, err := queryStatus(ctx, mon)
		if err != nil || st.Status != "finish-migrate" {
			return err
		}
		select {
		case <-ctx.Done():
			return errcode.Wrap(errcode.QMPError, context.Cause(ctx), "QEMU was still finishing the migration")
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// fileExtent returns a file's size and the bytes allocated to it.
func fileExtent(f *os.File) (size, allocated int64, err error) {
	fi, err := f.Stat()
	if err != nil {
		return 0, 0, err
	}
	size = fi.Size()
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		allocated = min(st.Blocks*512, size)
	}
	return size, allocated, nil
}

// Linux's lseek whence values for sparse files.
const (
	seekData = 3 // SEEK_DATA
	seekHole = 4 // SEEK_HOLE
)

// sparseReader reads a file's first size bytes, producing the zeros of its
// holes without reading them (SEEK_DATA/SEEK_HOLE): a mapped-ram file is
// mostly holes (every zero page of the guest).
type sparseReader struct {
	f         *os.File
	size, off int64
	end       int64 // end of the extent off is in
	hole      bool  // that extent is a hole
}

func (r *sparseReader) Read(p []byte) (int, error) {
	if r.off >= r.size {
		return 0, io.EOF
	}
	if r.off >= r.end {
		if err := r.nextExtent(); err != nil {
			return 0, err
		}
	}
	n := int(min(int64(len(p)), r.end-r.off))
	var err error
	if r.hole {
		clear(p[:n])
	} else {
		n, err = r.f.ReadAt(p[:n], r.off)
		if err == io.EOF && n > 0 {
			err = nil
		}
		if err == io.EOF { // the file shrank under us
			err = io.ErrUnexpectedEOF
		}
	}
	r.off += int64(n)
	return n, err
}

// nextExtent finds the data or hole extent that starts at r.off.
func (r *sparseReader) nextExtent() error {
	fd := int(r.f.Fd())
	data, err := syscall.Seek(fd, r.off, seekData)
	switch {
	case errors.Is(err, syscall.ENXIO): // nothing but a hole up to the end
		r.hole, r.end = true, r.size
		return nil
	case errors.Is(err, syscall.EINVAL): // no SEEK_DATA here: all data
		r.hole, r.end = false, r.size
		return nil
	case err != nil:
		return err
	case data > r.off:
		r.hole, r.end = true, min(data, r.size)
		return nil
	}
	hole, err := syscall.Seek(fd, r.off, seekHole)
	if err != nil {
		return err
	}
	r.hole, r.end = false, min(max(hole, r.off+1), r.size)
	return nil
}

// sparseWriter writes a stream into a file at increasing offsets, leaving
// every all-zero page out: the file was truncated to its full size, so
// those read back as the zeros they are, and take no space.
type sparseWriter struct {
	f   *os.File
	off int64
}

const sparsePage = 4096

var zeroPage [sparsePage]byte

func (w *sparseWriter) Write(p []byte) (int, error) {
	isZero := func(b []byte) bool { return bytes.Equal(b, zeroPage[:len(b)]) }
	for i := 0; i < len(p); {
		j := min(i+sparsePage, len(p))
		if isZero(p[i:j]) {
			i = j
			continue
		}
		k := j // extend the run of pages with data
		for k < len(p) {
			e := min(k+sparsePage, len(p))
			if isZero(p[k:e]) {
				break
			}
			k = e
		}
		if _, err := w.f.WriteAt(p[i:k], w.off+int64(i)); err != nil {
			return i, err
		}
		i = k
	}
	w.off += int64(len(p))
	return len(p), nil
}

// restoreMappedRAM is Restore's mapped-ram path, from Restore, which has
// loaded and checked the image and the target: it stages the verified file,
// then has QEMU load it.
func restoreMappedRAM(ctx context.Context, mon Monitor, repo ociimage.Repository, layers []ocispec.Descriptor, opts RestoreOptions, res *RestoreResult, start time.Time) (out *RestoreResult, err error) {
	cfg := res.Config
	dir := stagingDir(opts.StagingDir)
	// The checkpoint's bound, whatever sizes the image declares: the VM's
	// memory is the target's, which matches it (checkRestorable).
	ctx, abort := context.WithCancelCause(ctx)
	defer abort(nil)
	staging, err := newStagingFile(dir, os.O_RDONLY, mon, cfg.Record.MemoryBytes, opts.StagingOwner, abort)
	if err != nil {
		return nil, err
	}
	defer func() {
		// Last, so that QEMU 9.0 closes its descriptor: it does only while
		// the VM runs, that is once finishRestore has continued it. QEMU
		// reads the file: one that holds it open for writing now fails the
		// restore; one that keeps reading it (9.0, paused) is let be.
		serr := staging.settle(ctx, err != nil)
		if werr := staging.exceeded(); werr != nil {
			serr = werr
		}
		if err == nil && serr != nil {
			out, err = nil, serr
		}
	}()
	f := staging.file()
	if err := f.Truncate(cfg.RawBytes); err != nil {
		return nil, stagingError(dir, err, "sizing the staging file")
	}
	res.Durations.Prepare = time.Since(start)

	// Every chunk is verified before it is written, and QEMU sees the file
	// only once all of them are: a bad chunk leaves the target untouched.
	streamStart := time.Now()
	n, err := chunk.DecodeStream(ctx, layers, repo, &sparseWriter{f: f}, opts.Stream)
	if err != nil {
		// A failed write names the staging file; a failed read from the
		// store is reported as it is.
		var perr *os.PathError
		if errors.As(err, &perr) && perr.Path == f.Name() {
			return nil, stagingError(dir, err, "writing the staging file")
		}
		return nil, err
	}
	if n != cfg.RawBytes {
		return nil, errcode.New(errcode.InvalidInput, "the image's chunks hold %d bytes, its config declares %d", n, cfg.RawBytes)
	}
	res.RawBytes = n

	if _, err := prepareMigration(ctx, mon, migrationSettings{mappedRAM: true}); err != nil {
		return nil, err // a target is discarded on failure: its settings need no undo
	}
	sub := mon.Subscribe()
	defer sub.Close()
	if err := staging.pass(ctx); err != nil {
		return nil, err
	}
	if err := mon.Execute(ctx, "migrate-incoming", map[string]string{"uri": staging.uri()}, nil); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "starting the incoming migration from the staging file")
	}
	if _, err := waitMigration(ctx, mon, sub, nil); err != nil {
		// Whatever QEMU made of the file, it must not run it.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		_ = mon.Execute(cctx, "quit", nil, nil)
		cancel()
		return nil, errcode.Wrap(errcode.Of(err), err, "QEMU failed to load the verified state, so it was told to quit: start a new one to try again")
	}
	staging.free() // QEMU has loaded it
	res.Durations.Stream = time.Since(streamStart)
	return finishRestore(ctx, mon, opts, res, start)
}

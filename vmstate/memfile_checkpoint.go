package vmstate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// memFileCheckpoint carries one memory-file checkpoint's parts between its
// phases (find the parent, pre-copy, save while stopped, store while
// running): it is the format's capturePhases.
type memFileCheckpoint struct {
	*checkpointRun
	be        *RAMBackend
	f         *os.File
	parent    *parentImage
	parentMap *ramfile.Parent
	// capture and pre are closed by close unless a phase handed them on.
	capture *ramfile.Capture
	pre     *precopied
	// devices streams the device state when no pre-copy carried it.
	devices  *streamCapture
	recorded *ramfile.PageMap // the page map of this checkpoint, stored
}

// openCheckpointRAMFile opens the VM's RAM file and checks that it holds
// the whole memory backend.
func openCheckpointRAMFile(ctx context.Context, mon Monitor, opts CheckpointOptions, be *RAMBackend) (*os.File, error) {
	open := opts.OpenRAMFile
	if open == nil {
		open = func(p string) (*os.File, error) { return openRAMFile(ctx, mon, p) }
	}
	f, err := open(be.MemPath)
	if err != nil {
		return nil, errcode.Ensure(errcode.InvalidInput, err, "opening the VM's RAM file %s (QEMU's mem-path)", be.MemPath)
	}
	if fi, err := f.Stat(); err != nil {
		f.Close()
		return nil, errcode.Wrap(errcode.Internal, err, "reading the VM's RAM file %s", be.MemPath)
	} else if fi.Size() < be.Bytes {
		f.Close()
		return nil, errcode.New(errcode.InvalidInput, "the VM's RAM file %s holds %d bytes, less than its memory backend's %d", be.MemPath, fi.Size(), be.Bytes)
	}
	return f, nil
}

// findParent picks the checkpoint this one is a delta on, if any.
func (c *memFileCheckpoint) findParent(ctx context.Context) error {
	parent, why, err := findParent(ctx, c.repo, c.opts, c.be, c.f)
	if err != nil {
		return err
	}
	c.parent = parent
	c.res.RAMParentNote = why
	if parent != nil {
		c.parentMap, c.res.RAMParentTrust = &parent.Parent, parent.trust
	}
	return nil
}

// close releases what no phase handed on: the device state's migration,
// a pre-copy's files, then the captured pages.
func (c *memFileCheckpoint) close() {
	if c.devices != nil {
		c.devices.close()
	}
	if c.pre != nil {
		c.pre.close()
	}
	if c.capture != nil {
		c.capture.Close()
	}
}

// tryPrecopy captures a running VM in snapshot mode by a pre-copy, where
// QEMU stops it only for the final pass (precopy.go). In pause mode the VM
// stays stopped anyway, and a scan of the file is the faster way; it is
// also the way back from a pre-copy that failed before QEMU stopped the
// VM, and the only way where QEMU's dirty log misses the guest's writes
// (precopyUntrusted). An error returned means no scan can follow.
func (c *memFileCheckpoint) tryPrecopy(ctx context.Context) error {
	res := c.res
	res.RAMCapture = CaptureScan
	try := c.opts.Mode == ModeSnapshot && c.st.Running
	if try {
		if why := precopyUntrusted(ctx, c.mon, res.Config.Record.QEMUVersion); why != "" {
			res.RAMCaptureNote, try = why, false
		}
	}
	if !try {
		return nil
	}
	precopyStart := time.Now()
	var perr error
	c.pre, perr = precopy(ctx, c.mon, c.g, c.be, c.f, c.parentMap, stagingDir(c.opts.StagingDir))
	res.Durations.Precopy = time.Since(precopyStart)
	if perr != nil {
		if ctx.Err() != nil || errors.Is(perr, errNoFallback) {
			return perr
		}
		if now, qerr := queryStatus(ctx, c.mon); qerr != nil || !now.Running {
			return perr // completed: QEMU migrates it again only once it ran
		}
		res.RAMCaptureNote = precopyNote(perr)
		return nil
	}
	res.RAMCapture = CapturePrecopy
	c.capture, c.pre.capture = c.pre.capture, nil
	c.g.stoppedAt = c.pre.stoppedAt
	if c.pre.unsent > 0 {
		res.RAMCaptureNote = fmt.Sprintf("%d pages QEMU did not send (free-page hints) were read from the RAM file, the VM stopped", c.pre.unsent)
	}
	return nil
}

// save runs while the VM is stopped: the device state (unless a pre-copy
// carried it), then the changed pages copied aside.
func (c *memFileCheckpoint) save(ctx context.Context) error {
	if c.devices != nil {
		if err := c.devices.save(ctx); err != nil {
			return err
		}
	}
	res := c.res
	c.g.phase = "copying the changed RAM pages aside"
	scanStart := time.Now()
	var err error
	if c.capture == nil {
		c.capture, err = ramfile.Scan(c.f, c.be.Bytes, c.parentMap, stagingDir(c.opts.StagingDir))
	}
	if why := c.chainTooLong(err); why != "" {
		// A fresh base instead (rare: a chain of large deltas). The VM
		// is stopped, so the file is the RAM of this checkpoint.
		res.RAMParentNote = why
		c.capture.Close()
		c.parent, res.RAMParentTrust = nil, ""
		res.RAMCapture = CaptureScan // a pre-copy kept only the pages that changed
		c.capture, err = ramfile.Scan(c.f, c.be.Bytes, nil, stagingDir(c.opts.StagingDir))
	}
	res.Durations.Save = time.Since(scanStart)
	if err == nil {
		res.RAMRefutedPages = c.capture.Refuted
	}
	return err
}

// storeDevices stores a pre-copy's device state, once the VM runs.
func (c *memFileCheckpoint) storeDevices(ctx context.Context) error {
	if c.pre == nil {
		return nil
	}
	res := c.res
	c.g.phase = "storing the device state"
	start := time.Now()
	stream, err := chunk.EncodeStream(ctx, newBoundedStream(io.LimitReader(c.pre.devices, c.pre.deviceLen), res.Config.Record.MemoryBytes), c.repo, c.opts.Stream)
	if err != nil {
		return err
	}
	if stream.RawBytes == 0 {
		return errcode.New(errcode.QMPError, "QEMU's pre-copy carried no device state")
	}
	res.Stream, res.Config.RawBytes = stream, stream.RawBytes
	res.Durations.Stream = time.Since(start)
	return nil
}

// store runs once the VM runs again: the device state of a pre-copy, then
// the captured pages, as a delta on the parent's layers or a base.
func (c *memFileCheckpoint) store(ctx context.Context) error {
	if err := c.storeDevices(ctx); err != nil {
		return err
	}
	res := c.res
	c.g.phase = "storing the RAM pages"
	storeStart := time.Now()
	devices := res.Stream.RawBytes
	progress := c.opts.Stream.Progress
	stored, err := c.capture.Store(ctx, c.repo, ramfile.StoreOptions{Workers: c.opts.Stream.Workers, Level: c.opts.Stream.Level, Parent: c.parentIndex(), Progress: func(pages int64) {
		if progress != nil {
			progress(devices + pages*ramfile.PageSize)
		}
	}})
	if err != nil {
		return err
	}
	c.addStored(stored)
	res.Durations.Stream += time.Since(storeStart)
	c.recorded = c.capture.Map
	c.capture.Close()
	c.capture = nil
	return nil
}

// addStored puts the stored pages into the result: the chain in the
// config, and the layers after the device state's (page map, the chain's
// index, the parent's packs, this checkpoint's).
func (c *memFileCheckpoint) addStored(stored ramfile.Stored) {
	res := c.res
	dataBytes := int64(c.capture.Map.DataPages()) * ramfile.PageSize
	link := ChainLink{Created: res.Config.Created, Regions: stored.Frames, Packs: len(stored.Packs), StoredBytes: stored.StoredBytes - layerBytes(stored.PageMap), ChangedPages: c.capture.Changed()}
	var chain []ChainLink
	var parentPacks []ocispec.Descriptor
	if c.parent != nil {
		chain = append(chain, c.parent.cfg.RAM.Chain...)
		chain[len(chain)-1].Manifest = c.parent.desc.Digest
		parentPacks = c.parent.ram.Packs
	}
	res.Config.RAM = &RAMConfig{Backend: c.be.ID, Bytes: c.be.Bytes, DataBytes: dataBytes, Chain: append(chain, link)}
	layers := append([]ocispec.Descriptor(nil), res.Stream.Layers...)
	layers = append(layers, stored.PageMap...)
	layers = append(layers, stored.Index)
	layers = append(layers, parentPacks...)
	layers = append(layers, stored.Packs...)
	res.Stream.Layers = layers
	res.Stream.StoredBytes += stored.StoredBytes + layerBytes(parentPacks)
	res.Stream.UploadedBytes += stored.UploadedBytes
}

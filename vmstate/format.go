package vmstate

import (
	"context"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// Format is vmspec.Format, by the name vmstate's own code uses (one
// type: defined in the leaf so that agent/api carries it without vmstate).
type Format = vmspec.Format

// The formats (vmspec).
const (
	FormatAuto       = vmspec.FormatAuto
	FormatStream     = vmspec.FormatStream
	FormatMappedRAM  = vmspec.FormatMappedRAM
	FormatMemoryFile = vmspec.FormatMemoryFile
)

// formatNames are the formats a checkpoint may be asked for.
var formatNames = []Format{FormatAuto, FormatStream, FormatMappedRAM, FormatMemoryFile}

// checkFormat refuses a config whose format this vmsnap does not know.
func (c Config) checkFormat() error {
	switch c.Format {
	case "", FormatStream:
		if c.DataBytes != 0 || c.RAM != nil {
			return errcode.New(errcode.InvalidInput, "the image's config declares %d bytes of staged data for a stream", c.DataBytes)
		}
		return nil
	case FormatMappedRAM:
		if c.DataBytes < 0 || c.DataBytes > c.RawBytes {
			return errcode.New(errcode.InvalidInput, "the image's config declares %d bytes of data in a %d-byte mapped-ram file", c.DataBytes, c.RawBytes)
		}
		return nil
	case FormatMemoryFile:
		if c.RAM == nil {
			return errcode.New(errcode.InvalidInput, "the image's config declares the memory-file format without a RAM file")
		}
		return ramfile.CheckSize(c.RAM.Bytes)
	}
	if c.RAM != nil {
		return errcode.New(errcode.InvalidInput, "the image's config describes a RAM file for the %s format", c.formatName())
	}
	return errcode.New(errcode.InvalidInput, "the image holds VM state in format %q, which this vmsnap does not know (a newer vmsnap wrote it?)", c.Format)
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
		return "", unknownName("state format", string(opts.Format), formatNames...)
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

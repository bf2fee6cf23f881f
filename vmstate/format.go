package vmstate

import (
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

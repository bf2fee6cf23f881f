package vmstate

import (
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// Format is how a VM state image holds the VM's state.
type Format string

const (
	// FormatAuto picks memory-file for a VM whose RAM is a shared
	// memory-backend-file (in pause and snapshot mode), else mapped-ram in
	// snapshot mode where the source QEMU has it and the staging directory
	// has room, else the stream. It is an option, never recorded.
	FormatAuto Format = "auto"
	// FormatStream is QEMU's sequential migration stream, as QEMU writes it
	// into a pipe. Configs leave it out (an empty format is a stream), so
	// that their JSON is what it was before formats existed.
	FormatStream Format = "stream"
	// FormatMappedRAM is QEMU's mapped-ram file (QEMU 9.0 or later): the
	// image's chunks, in order, are that file's bytes.
	FormatMappedRAM Format = "mapped-ram"
)

// ParseFormat accepts the format names of the command line ("" is auto).
func ParseFormat(s string) (Format, error) {
	switch f := Format(s); f {
	case "":
		return FormatAuto, nil
	case FormatAuto, FormatStream, FormatMappedRAM, FormatMemoryFile:
		return f, nil
	}
	return "", errcode.New(errcode.Usage, "unknown state format %q: use auto, stream, mapped-ram or memory-file", s)
}

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

// Package vmspec names how a VM's state is checkpointed: the Mode (what
// happens to the VM) and the Format (how the image holds its state), with
// the parsing of their names. It is a leaf: package vmstate implements
// them, and the JSON documents of agent/api carry them, without api
// linking vmstate, its QMP client and its store.
package vmspec

import "github.com/vmsnap/vmsnap/internal/errcode"

// Mode says what happens to the source VM during and after a checkpoint.
type Mode string

const (
	// ModePause stops the VM and leaves it stopped once the snapshot is
	// stored: the source is about to be discarded. On failure it runs again.
	ModePause Mode = "pause"
	// ModeSnapshot stops the VM, captures it and lets it run again.
	ModeSnapshot Mode = "snapshot"
	// ModeLive uses QEMU's background-snapshot: the VM keeps running and the
	// image holds its state at the start of the checkpoint.
	ModeLive Mode = "live"
)

// ParseMode accepts the mode names of the command line.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModePause, ModeSnapshot, ModeLive:
		return m, nil
	}
	return "", errcode.New(errcode.Usage, "unknown mode %q: use pause, snapshot or live", s)
}

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
	// FormatMemoryFile is the guest's RAM stored page-addressed beside the
	// device state (package vmstate/ramfile). It needs a shared
	// memory-backend-file.
	FormatMemoryFile Format = "memory-file"
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

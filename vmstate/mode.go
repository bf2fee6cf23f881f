package vmstate

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

package vmstate

import (
	"slices"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

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
	return parseName(s, "mode", ModePause, ModeSnapshot, ModeLive)
}

// parseName accepts one of names, the values of a command line's option
// (what names it in the error, which lists them).
func parseName[T ~string](s, what string, names ...T) (T, error) {
	if i := slices.Index(names, T(s)); i >= 0 {
		return names[i], nil
	}
	return "", unknownName(what, s, names...)
}

// unknownName is USAGE for a value that is none of names.
func unknownName[T ~string](what, s string, names ...T) error {
	list := make([]string, len(names))
	for i, n := range names {
		list[i] = string(n)
	}
	last := len(list) - 1
	return errcode.New(errcode.Usage, "unknown %s %q: use %s or %s", what, s, strings.Join(list[:last], ", "), list[last])
}

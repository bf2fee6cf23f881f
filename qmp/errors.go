package qmp

import (
	"fmt"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Error is QEMU's refusal of a command: the "error" member of a QMP reply.
//
// Execute returns it wrapped in an *errcode.Error with code QMP_ERROR, so both
// errcode.Of(err) and errors.As(err, &qerr) work; callers that need to react
// to a particular refusal (a missing device, a migration already running)
// switch on Class.
type Error struct {
	Command string // the command QEMU refused
	Class   string // QEMU's error class, e.g. GenericError, CommandNotFound, DeviceNotFound
	Desc    string // QEMU's human-readable description
}

func (e *Error) Error() string {
	return fmt.Sprintf("qmp: %s: %s: %s", e.Command, e.Class, e.Desc)
}

// ErrorCode classifies the error for callers that do not import errcode.
func (e *Error) ErrorCode() string { return string(errcode.QMPError) }

// truncate shortens a message from QEMU for inclusion in an error.
func truncate(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "..."
}

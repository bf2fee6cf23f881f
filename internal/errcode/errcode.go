// Package errcode is vmsnap's one error type: every failure that reaches a
// caller carries a Code, and the CLI's exit status, its --json error object and
// the agent's API responses are all derived from that code.
//
// Callers outside this module switch on the code without importing this
// package: every *Error has an ErrorCode() string method, so
//
//	var coded interface{ ErrorCode() string }
//	if errors.As(err, &coded) && coded.ErrorCode() == "DIGEST_MISMATCH" { ... }
//
// It is not a logging or wrapping framework: messages are written once, where
// the failure is understood, and say what to do about it.
//
// One failure has the same code wherever it happens: a full disk (ENOSPC or
// EDQUOT) while writing anything local, whether a blob into an OCI layout,
// a staged image or a restored disk overlay, is INTERNAL ("an unexpected
// local failure"), and its message names the directory and says to free
// space. Wrap and Ensure see to that, whatever code their caller gave.
package errcode

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
)

// Code classifies a failure. The set is part of vmsnap's command contract.
type Code string

const (
	Usage          Code = "USAGE"           // bad flags or arguments
	VMNotFound     Code = "VM_NOT_FOUND"    // no QEMU behind the socket, pod or container named
	QMPError       Code = "QMP_ERROR"       // QEMU refused a command or the monitor failed
	CompatMismatch Code = "COMPAT_MISMATCH" // the target QEMU differs from the recorded VM
	DigestMismatch Code = "DIGEST_MISMATCH" // stored bytes do not match their digest
	TagNotAllowed  Code = "TAG_NOT_ALLOWED" // restore by tag without --allow-tag
	AuthFailed     Code = "AUTH_FAILED"     // the registry refused our credentials
	RegistryError  Code = "REGISTRY_ERROR"  // any other failure of the image store
	Busy           Code = "BUSY"            // another operation holds the VM
	InvalidInput   Code = "INVALID_INPUT"   // malformed image, header, record or request
	Internal       Code = "INTERNAL"        // a bug or an unexpected local failure
	// Forbidden: the node agent's policy does not let this caller do this
	// (another namespace's VM, a repository outside the allow list, a
	// layout outside the layout root).
	Forbidden Code = "FORBIDDEN"
)

// Codes lists every code in the order of their exit statuses.
var Codes = []Code{Internal, Usage, VMNotFound, QMPError, CompatMismatch, DigestMismatch,
	TagNotAllowed, AuthFailed, RegistryError, Busy, InvalidInput, Forbidden}

// ExitStatus is the process exit status for a failure with this code.
// 0 is success; INTERNAL is 1, the codes that follow count up from 2.
func (c Code) ExitStatus() int {
	for i, k := range Codes {
		if k == c {
			return i + 1
		}
	}
	return 1
}

// Error is a failure with a code. Details, when present, list individual
// findings (for example each difference of a compatibility check).
type Error struct {
	Code    Code
	Msg     string
	Details []string
	Err     error

	format string // Msg's format and arguments, when they name a Field
	args   []any
}

func (e *Error) Error() string {
	if e == nil {
		return "<nil>" // a bug elsewhere, still to be shown rather than crash on
	}
	var b strings.Builder
	b.WriteString(e.Msg)
	if len(e.Details) > 0 {
		b.WriteString(": ")
		b.WriteString(strings.Join(e.Details, "; "))
	}
	if e.Err != nil {
		if b.Len() > 0 {
			b.WriteString(": ")
		}
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

func (e *Error) Unwrap() error {
	if e == nil {
		return nil
	}
	return e.Err
}

// ErrorCode lets callers outside this module classify the error.
func (e *Error) ErrorCode() string {
	if e == nil {
		return string(Internal)
	}
	return string(e.Code)
}

// New returns an error with a code and a formatted message.
func New(code Code, format string, args ...any) error {
	return keepFormat(&Error{Code: code, Msg: fmt.Sprintf(format, args...)}, format, args)
}

// Wrap returns an error with a code whose message is the formatted text
// followed by err's. A nil err gives nil. If err already carries a code, the
// new code still wins: the wrapper knows better what the failure means.
// The exception is a full disk, which is always NoSpace.
func Wrap(code Code, err error, format string, args ...any) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		code, err = NoSpace, explainDiskFull(err)
	}
	return keepFormat(&Error{Code: code, Msg: fmt.Sprintf(format, args...), Err: err}, format, args)
}

// NoSpace is the code of a full disk or an exhausted quota while writing
// anything local. None of the codes fits it well: it is neither a bug nor
// a failure of the image store or of QEMU, but an operator's to fix on this
// node. INTERNAL, "an unexpected local failure", is the closest, and the
// message says what to do.
const NoSpace = Internal

// noSpaceError is a full disk, with what to do about it.
type noSpaceError struct {
	err error
	dir string // the directory written to, if known
}

func (e *noSpaceError) Unwrap() error { return e.err }

func (e *noSpaceError) Error() string {
	where := "the local disk"
	if e.dir != "" {
		where = "the filesystem holding " + e.dir
	}
	fix := "free space there"
	if errors.Is(e.err, syscall.EDQUOT) {
		fix = "free space there or raise the quota"
	}
	return fmt.Sprintf("%v; %s is full: %s, then try again", e.err, where, fix)
}

// explainDiskFull adds to a full disk's error what to do, once.
func explainDiskFull(err error) error {
	var done *noSpaceError
	if errors.As(err, &done) {
		return err
	}
	full := &noSpaceError{err: err}
	var pe *fs.PathError
	var le *os.LinkError
	switch {
	case errors.As(err, &pe):
		full.dir = filepath.Dir(pe.Path)
	case errors.As(err, &le):
		full.dir = filepath.Dir(le.New)
	}
	return full
}

// WithDetails returns an error with a code, a message and a list of findings.
func WithDetails(code Code, details []string, format string, args ...any) error {
	return &Error{Code: code, Msg: fmt.Sprintf(format, args...), Details: details}
}

// Of returns the code of the outermost coded error in err's chain. An error
// without one is INTERNAL.
func Of(err error) Code {
	if err == nil {
		return ""
	}
	var e *Error
	if errors.As(err, &e) {
		return Code(e.ErrorCode())
	}
	// Errors that crossed a process boundary (the agent's API) carry their
	// code without being an *Error.
	// A code this vmsnap does not know (from a newer agent) is INTERNAL.
	var c interface{ ErrorCode() string }
	if errors.As(err, &c) && slices.Contains(Codes, Code(c.ErrorCode())) {
		return Code(c.ErrorCode())
	}
	return Internal
}

// Is reports whether err carries code c.
func Is(err error, c Code) bool { return err != nil && Of(err) == c }

// Ensure returns err unchanged if it carries a code, and wraps it with code c
// otherwise (a full disk with NoSpace). It is how a layer states the default
// meaning of failures from below it without hiding more specific codes.
func Ensure(c Code, err error, format string, args ...any) error {
	if err == nil || Has(err) {
		return err
	}
	return Wrap(c, err, format, args...)
}

// Has reports whether err carries a code: an *Error, or an error from
// elsewhere (the agent's API) with an ErrorCode method.
func Has(err error) bool {
	var e *Error
	var c interface{ ErrorCode() string }
	return errors.As(err, &e) || errors.As(err, &c)
}

// Summary is err's message without the details list, for documents that
// carry the details separately.
func Summary(err error) string {
	var e *Error
	if errors.As(err, &e) && e != nil && len(e.Details) > 0 && e == err {
		return (&Error{Code: e.Code, Msg: e.Msg, Err: e.Err}).Error()
	}
	return err.Error()
}

// DetailsOf returns the findings of the outermost coded error in err's chain.
func DetailsOf(err error) []string {
	var e *Error
	if errors.As(err, &e) {
		if e == nil {
			return nil
		}
		return e.Details
	}
	var d interface{ ErrorDetails() []string }
	if errors.As(err, &d) {
		return d.ErrorDetails()
	}
	return nil
}

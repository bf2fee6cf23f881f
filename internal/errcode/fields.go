package errcode

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// Field names, in an error message, the request field the error concerns:
// its API name (format, stagingDir). A library states the problem in terms
// of the request it was given; the CLI, which took the request as flags,
// shows the flag instead (WithFieldNames). Pass it to New, Wrap or Ensure as
// a format argument (%s); it formats as its API name in backquotes
// (`stagingDir`), so that a message that crossed the agent's API as text
// still says which words are fields (RenameQuotedFields).
type Field string

func (f Field) String() string { return "`" + string(f) + "`" }

var quotedField = regexp.MustCompile("`([a-z][A-Za-z0-9]*)`")

// RenameQuotedFields writes every field a message names (as Field formats
// it) as name gives it: for a message that arrived as text, such as an
// agent's error, whose Fields WithFieldNames can no longer see.
func RenameQuotedFields(msg string, name func(Field) string) string {
	return quotedField.ReplaceAllStringFunc(msg, func(q string) string {
		return name(Field(strings.Trim(q, "`")))
	})
}

// New and Wrap keep the format and arguments of a message that names a
// Field, so that WithFieldNames can write it again.
func keepFormat(e *Error, format string, args []any) *Error {
	for _, a := range args {
		if _, ok := a.(Field); ok {
			e.format, e.args = format, args
			break
		}
	}
	return e
}

// WithFieldNames returns err with every Field in its messages written as
// name gives it (the CLI: as its flag). Messages of wrappers that are not an
// *Error keep their own text around the renamed one, whether they wrap one
// error or several (errors.Join); an error without Fields is returned
// unchanged. Codes and details are kept.
func WithFieldNames(err error, name func(Field) string) error {
	renamed, _ := withFieldNames(err, name)
	return renamed
}

// withFieldNames is WithFieldNames, saying whether anything was renamed.
// It never compares errors: an error may be of a type that == cannot
// compare (a slice of errors, as go-containerregistry's transport returns),
// and comparing two of those panics.
func withFieldNames(err error, name func(Field) string) (error, bool) {
	if e, ok := err.(*Error); ok && e != nil {
		return renameError(e, name)
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		inner := u.Unwrap()
		renamed, changed := withFieldNames(inner, name)
		if !changed {
			return err, false
		}
		return &renamedError{err: err, msg: strings.Replace(err.Error(), inner.Error(), renamed.Error(), 1)}, true
	case interface{ Unwrap() []error }:
		msg, changed := err.Error(), false
		for _, inner := range u.Unwrap() {
			if renamed, ok := withFieldNames(inner, name); ok {
				msg, changed = strings.Replace(msg, inner.Error(), renamed.Error(), 1), true
			}
		}
		if !changed {
			return err, false
		}
		return &renamedError{err: err, msg: msg}, true
	}
	return err, false
}

// renameError is withFieldNames of an *Error: its own message, then its
// chain.
func renameError(e *Error, name func(Field) string) (error, bool) {
	inner, changed := withFieldNames(e.Err, name)
	if e.format == "" && !changed {
		return e, false
	}
	c := *e
	c.Err = inner
	if e.format != "" {
		args := slices.Clone(e.args)
		for i, a := range args {
			if f, ok := a.(Field); ok {
				args[i] = name(f)
			}
		}
		c.Msg = fmt.Sprintf(e.format, args...)
	}
	return &c, true
}

// renamedError is a wrapper from elsewhere (fmt.Errorf, errors.Join) whose
// message WithFieldNames wrote again; its chain is the original's.
type renamedError struct {
	err error
	msg string
}

func (e *renamedError) Error() string { return e.msg }
func (e *renamedError) Unwrap() error { return e.err }

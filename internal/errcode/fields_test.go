package errcode

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// multiErrs is what go-containerregistry's transport returns when both
// schemes of its ping fail: a slice, which == cannot compare, without
// Unwrap.
type multiErrs []error

func (m multiErrs) Error() string {
	var parts []string
	for _, e := range m {
		parts = append(parts, e.Error())
	}
	return strings.Join(parts, "; ")
}

// valueWrapper is a comparable struct type that holds an error: comparing
// two of them compares what they hold, and panics if that is a slice.
type valueWrapper struct{ err error }

func (w valueWrapper) Error() string { return w.err.Error() }
func (w valueWrapper) Unwrap() error { return w.err }

// The CLI's error report of an unreachable registry panicked ("comparing
// uncomparable type transport.multierrs"): WithFieldNames compared the
// renamed chain with the original. Every shape of chain that holds an
// uncomparable error, with and without fields to rename, comes back.
func TestWithFieldNamesOfUncomparableErrors(t *testing.T) {
	flag := func(f Field) string { return "--" + string(f) }
	multi := multiErrs{errors.New("dial tcp 127.0.0.1:1: connect: connection refused"), errors.New("refusing plain HTTP")}
	withField := New(Usage, "pass %s", Field("caFile"))
	for name, c := range map[string]struct {
		err  error
		want string
	}{
		"as the registry client wraps it": {Wrap(RegistryError, valueWrapper{multi}, "cannot reach registry r"),
			"cannot reach registry r: dial tcp 127.0.0.1:1: connect: connection refused; refusing plain HTTP"},
		"bare":                    {multi, multi.Error()},
		"in fmt.Errorf":           {fmt.Errorf("pulling: %w", valueWrapper{multi}), "pulling: " + multi.Error()},
		"a slice of *Error":       {multiErrs{withField, withField}, "pass `caFile`; pass `caFile`"},
		"joined, with a field":    {errors.Join(valueWrapper{multi}, withField), multi.Error() + "\npass --caFile"},
		"two %w, with a field":    {fmt.Errorf("a: %w; b: %w", multi, Wrap(Internal, withField, "x")), "a: " + multi.Error() + "; b: x: pass --caFile"},
		"joined, nothing renamed": {errors.Join(multi, multi), multi.Error() + "\n" + multi.Error()},
		"typed nil *Error":        {Wrap(Internal, (*Error)(nil), "outer"), "outer: <nil>"},
	} {
		t.Run(name, func(t *testing.T) {
			got := WithFieldNames(c.err, flag)
			if got.Error() != c.want {
				t.Fatalf("%q, want %q", got.Error(), c.want)
			}
			if Of(got) != Of(c.err) {
				t.Fatalf("code %s, want %s", Of(got), Of(c.err))
			}
		})
	}
}

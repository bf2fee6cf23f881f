package errcode

import (
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
)

// Recovered is the error of a recovered panic: INTERNAL, with the panic's
// value and the function it happened in, and what to do about it. It is
// what a user sees instead of a stack trace; call it from the deferred
// function that recovered, which is where the stack still shows where the
// panic happened. Its message never holds a stack.
func Recovered(v any) error {
	// %v: fmt survives a value whose Error or String method panics too.
	return &Error{Code: Internal, Msg: fmt.Sprintf("%v%s: this is a bug in vmsnap; please report it with the command that failed and this message", v, panicSite())}
}

// Safely runs f and returns its error, or a panic in it as Recovered. It is
// for goroutines: a panic there would end the whole process, however
// carefully its caller recovers.
func Safely(f func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = Recovered(v)
		}
	}()
	return f()
}

// panicSite names the function a panic happened in (" in pkg.Func
// (file.go:12)"), or "" if the stack does not show one. It is called from
// a deferred function while the panic unwinds: the frames below
// runtime.gopanic are those of the panic's origin.
func panicSite() string {
	pcs := make([]uintptr, 64)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs)])
	seenPanic := false
	for {
		f, more := frames.Next()
		switch {
		case f.Function == "runtime.gopanic":
			seenPanic = true
		case seenPanic && !strings.HasPrefix(f.Function, "runtime."):
			return fmt.Sprintf(" in %s (%s:%d)", shortFunc(f.Function), filepath.Base(f.File), f.Line)
		}
		if !more {
			return ""
		}
	}
}

// shortFunc drops a function name's module path: ociimage/chunk.decode.
func shortFunc(name string) string {
	const module = "github.com/vmsnap/vmsnap/"
	return strings.TrimPrefix(name, module)
}

package errcode

import (
	"errors"
	"strings"
	"testing"
)

//go:noinline
func indexOutOfRange(s []int, i int) int { return s[i] }

// A panic becomes INTERNAL with its value, where it happened and what to
// do, without a stack.
func TestSafelyTurnsAPanicIntoInternal(t *testing.T) {
	err := Safely(func() error { _ = indexOutOfRange([]int{1}, 3); return nil })
	if Of(err) != Internal {
		t.Fatalf("code %s, want INTERNAL: %v", Of(err), err)
	}
	msg := err.Error()
	for _, want := range []string{"index out of range [3] with length 1", "in internal/errcode.indexOutOfRange (recovered_test.go:", "this is a bug in vmsnap; please report it"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q lacks %q", msg, want)
		}
	}
	if strings.Contains(msg, "goroutine") || strings.Count(msg, "\n") > 0 {
		t.Errorf("the message holds a stack: %q", msg)
	}
	sentinel := errors.New("not a panic")
	if err := Safely(func() error { return sentinel }); err != sentinel {
		t.Fatalf("Safely changed an error: %v", err)
	}
}

type panickyString struct{}

func (panickyString) String() string { panic("String too") }

// A panic value whose String method panics itself is still described.
func TestRecoveredSurvivesAPanickyValue(t *testing.T) {
	err := Safely(func() error { panic(panickyString{}) })
	if Of(err) != Internal || !strings.Contains(err.Error(), "String too") {
		t.Fatalf("%v (%s)", err, Of(err))
	}
}

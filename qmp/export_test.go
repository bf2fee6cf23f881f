package qmp

import (
	"testing"
	"time"
)

// SetTimeoutsForTest shortens the greeting and command timeouts (a zero
// leaves one as it is) until the end of the test.
func SetTimeoutsForTest(t testing.TB, greeting, command time.Duration) {
	g, c := greetingTimeout, commandTimeout
	if greeting > 0 {
		greetingTimeout = greeting
	}
	if command > 0 {
		commandTimeout = command
	}
	t.Cleanup(func() { greetingTimeout, commandTimeout = g, c })
}

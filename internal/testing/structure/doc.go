// Package structure holds tests about the source tree itself: rules a reader
// relies on that the compiler does not check. It has no code of its own.
package structure

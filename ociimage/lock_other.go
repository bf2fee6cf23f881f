//go:build !(linux || darwin || freebsd || netbsd || openbsd || dragonfly)

package ociimage

import (
	"context"
	"errors"
)

// lockFile is not implemented here: without a lock, concurrent writers
// could lose each other's index entries, so writes are refused.
func lockFile(ctx context.Context, path string) (func(), error) {
	return nil, errors.New("writing OCI layouts is supported only on Linux and BSD-like systems")
}

package ociimage

import "io"

// readAtMost reads r to its end, refusing more than limit bytes with
// tooLarge's error without reading past the bound: how every file and
// answer ociimage reads whole is read (a layout's files, a credentials or
// CA file, a registry's manifest).
func readAtMost(r io.Reader, limit int64, tooLarge func() error) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, tooLarge()
	}
	return b, nil
}

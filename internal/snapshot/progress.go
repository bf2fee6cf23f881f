package snapshot

import "github.com/vmsnap/vmsnap/ociimage/chunk"

// Progress reports bytes done in a phase ("vmstate", "disk", "rootfs",
// "restore", "stage"). It may be nil.
type Progress func(phase string, bytes int64)

// bytes is the progress callback of one phase, or nil.
func (p Progress) bytes(phase string) func(int64) {
	if p == nil {
		return nil
	}
	return func(n int64) { p(phase, n) }
}

func (p Progress) stream(phase string, o chunk.StreamOptions) chunk.StreamOptions {
	o.Progress = p.bytes(phase)
	return o
}

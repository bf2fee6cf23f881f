package vmstate

import (
	"context"
	"os"
	"runtime"
	"syscall"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// QEMU 9.0 and later can save a stopped VM in its mapped-ram format: a
// normal migration stream whose RAM section gives every RAMBlock a bitmap
// and a region of its own, each page at a fixed offset of a seekable file
// (zero pages are left as holes), written by several multifd threads at
// once. vmsnap uses it where it can (Format, CheckpointOptions.Format):
//
//   - checkpoint: QEMU writes the state into a sparse staging file; in
//     snapshot mode the VM runs again as soon as QEMU is done, and the file
//     is then cut into chunks at fixed offsets (StreamOptions.Fixed), so
//     that a chunk of an unchanged region has the same digest as in the
//     previous checkpoint, and stored like a stream's chunks;
//   - restore: every chunk is fetched and verified into a sparse staging
//     file (zero pages are not written), and only then is QEMU told to load
//     it, with the same capabilities.
//
// QEMU gets both files as descriptors (add-fd over SCM_RIGHTS, then the URI
// file:/dev/fdset/N), never as paths: it may run in another container. The
// staging files are unlinked as soon as they are open, so that nothing is
// left behind, even if vmsnap is killed, and truncated through vmsnap's own
// descriptor once QEMU is done with them, since QEMU may keep its copy open
// (stagingFile.free).

// capMappedRAM and capMultifd are QEMU's names of the migration capabilities.
const (
	capMappedRAM = "mapped-ram"
	capMultifd   = "multifd"
)

// migrationCapabilities lists the migration capabilities QEMU has, with
// their current state.
func migrationCapabilities(ctx context.Context, mon Executor) (map[string]bool, error) {
	var caps []struct {
		Capability string `json:"capability"`
		State      bool   `json:"state"`
	}
	if err := mon.Execute(ctx, "query-migrate-capabilities", nil, &caps); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "query-migrate-capabilities")
	}
	out := make(map[string]bool, len(caps))
	for _, c := range caps {
		out[c.Capability] = c.State
	}
	return out, nil
}

// stagingDir is where the mapped-ram file is staged: dir, else $TMPDIR.
func stagingDir(dir string) string {
	if dir == "" {
		return os.TempDir()
	}
	return dir
}

// multifdChannels is how many threads QEMU writes the mapped-ram file with.
func multifdChannels() int64 { return int64(min(max(runtime.NumCPU(), 2), 8)) }

// waitFinalized waits until QEMU has left the finish-migrate run state: it
// sends the MIGRATION "completed" event a moment before, and refuses cont
// ("Migration is not finalized yet") until then.
func waitFinalized(ctx context.Context, mon Executor) error {
	for {
		st, err := queryStatus(ctx, mon)
		if err != nil || st.Status != "finish-migrate" {
			return err
		}
		select {
		case <-ctx.Done():
			return errcode.Wrap(errcode.QMPError, context.Cause(ctx), "QEMU was still finishing the migration")
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// fileExtent returns a file's size and the bytes allocated to it.
func fileExtent(f *os.File) (size, allocated int64, err error) {
	fi, err := f.Stat()
	if err != nil {
		return 0, 0, err
	}
	size = fi.Size()
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		allocated = min(st.Blocks*512, size)
	}
	return size, allocated, nil
}

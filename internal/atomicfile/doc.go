// Package atomicfile is the one way vmsnap replaces a file: the data goes
// to a temporary file beside the target (.NAME.vmsnap-tmp-RANDOM, so the
// rename cannot cross filesystems), which is fsynced, renamed over the
// target, and then the directory is fsynced so that the rename itself
// survives a crash. Readers, and the file after a crash, see the old content
// or all of the new, never a part.
//
// Create(path, perm) streams data of any size (Commit, or Abort, which is a
// no-op after Commit, so defer f.Abort() is always safe); WriteFile writes a
// small file in one call; SyncDir follows a create or remove that must
// survive a crash. Writes stay sparse (an aligned 64 KiB block of zeros is
// skipped), the mode is perm exactly whatever the umask, and Sync plus
// ReaderAt let a caller read the data back before it commits. A crash can
// leave a .vmsnap-tmp- file behind (TempInfix marks it), which is safe to
// delete.
//
// SyncDir tolerates exactly one error, EINVAL: some filesystems (FUSE,
// network filesystems, some overlay setups) cannot fsync a directory and say
// so; the rename is atomic there all the same. Every other error is real.
//
// It is not for files other processes write concurrently (the last rename
// wins), nor for moves across directories.
package atomicfile

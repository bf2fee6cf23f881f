package vmstate

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Staging space is planned with one bound per operation: maxStateBytes of
// the VM's memory, the most any staging file of that VM may hold (a
// mapped-ram file, or a memory-file capture's pages and device state). The
// free-space check and the watch on a file QEMU writes use that same
// bound. A check alone is not enough where one process runs several
// operations at once (the agent): each reserves its bound on the staging
// filesystem until its files are gone, and the next is checked against
// what is free and not reserved.

// maxKeptStaging is how many staging files this process keeps watching
// for one owner (CheckpointOptions.StagingOwner: the agent's tenant) after
// their operations ended because a QEMU did not close its descriptor: past
// it, no staging file is made for that owner (auto takes the stream).
// Counted per owner, so that one tenant's QEMUs cannot stop everyone's.
const maxKeptStaging = 64

var stagingSpace struct {
	sync.Mutex
	reserved map[[2]int32]int64 // by filesystem
	kept     map[string]int     // by owner (stagingFile.settle)
}

// freeSpace is what an unprivileged user may still allocate in dir (a
// variable for tests).
var freeSpace = func(dir string) (int64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return int64(st.Bavail) * st.Bsize, nil
}

// stagingRoom is nil if dir can take need bytes besides what the other
// operations of this process reserved on its filesystem. For a file QEMU
// gets a descriptor of (forQEMU), the filesystem must also have file
// leases (stagingFile.holders), and fewer than maxKeptStaging such files
// of owner may be kept after their operations.
func stagingRoom(dir string, need int64, forQEMU bool, owner string) error {
	stagingSpace.Lock()
	defer stagingSpace.Unlock()
	_, err := checkRoom(dir, need, forQEMU, owner)
	return err
}

// reserveStaging is stagingRoom, and reserves need bytes there until
// release is called (once; more calls do nothing).
func reserveStaging(dir string, need int64, forQEMU bool, owner string) (release func(), err error) {
	stagingSpace.Lock()
	defer stagingSpace.Unlock()
	fs, err := checkRoom(dir, need, forQEMU, owner)
	if err != nil {
		return nil, err
	}
	return reserve(fs, need), nil
}

// reserveCache reserves need bytes on the filesystem of a RAM cache while
// a file fills there (Prepare): the agent's caches are in its state
// directory, beside the staging files of running operations, and each
// must leave the others' room.
func reserveCache(dir string, need int64) (release func(), err error) {
	stagingSpace.Lock()
	defer stagingSpace.Unlock()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "checking the free space of the RAM cache %s", dir)
	}
	fs := [2]int32(st.Fsid.Val)
	free, err := freeSpace(dir)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "checking the free space of the RAM cache %s", dir)
	}
	if reserved := stagingSpace.reserved[fs]; free-reserved < need {
		return nil, errcode.New(errcode.Internal, "the RAM cache %s has %d MiB free (%d MiB of it for other operations under way), and this image's RAM file may need %d MiB: free space there or pick another directory with %s",
			dir, free>>20, reserved>>20, need>>20, errcode.Field("cacheDir"))
	}
	return reserve(fs, need), nil
}

// reserve adds need to what filesystem fs has reserved, until release is
// called (once; more calls do nothing). The caller holds stagingSpace's
// lock.
func reserve(fs [2]int32, need int64) (release func()) {
	if stagingSpace.reserved == nil {
		stagingSpace.reserved = map[[2]int32]int64{}
	}
	stagingSpace.reserved[fs] += need
	var once sync.Once
	return func() {
		once.Do(func() {
			stagingSpace.Lock()
			defer stagingSpace.Unlock()
			if stagingSpace.reserved[fs] -= need; stagingSpace.reserved[fs] <= 0 {
				delete(stagingSpace.reserved, fs)
			}
		})
	}
}

// checkRoom is stagingRoom's check, and the filesystem's id. The caller
// holds stagingSpace's lock.
func checkRoom(dir string, need int64, forQEMU bool, owner string) ([2]int32, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return [2]int32{}, stagingError(dir, err, "checking the free space")
	}
	if err := unix.Access(dir, unix.W_OK|unix.X_OK); err != nil {
		// A read-only root (the agent's container) has no room at all.
		return [2]int32{}, stagingError(dir, err, "checking the staging directory")
	}
	if forQEMU {
		if err := probeLeases(dir); err != nil {
			return [2]int32{}, err
		}
	}
	if kept := stagingSpace.kept[owner]; forQEMU && kept >= maxKeptStaging {
		return [2]int32{}, errcode.New(errcode.Internal, "%d staging files of %s are still held by QEMUs that did not close them when their operations ended (vmsnap keeps them empty until they do): no more are made for it until then", kept, ownerName(owner))
	}
	fs := [2]int32(st.Fsid.Val)
	free, err := freeSpace(dir)
	if err != nil {
		return fs, stagingError(dir, err, "checking the free space")
	}
	if reserved := stagingSpace.reserved[fs]; free-reserved < need {
		return fs, errcode.New(errcode.Internal, "staging directory %s has %d MiB free (%d MiB of it for other operations under way), and this operation may need up to %d MiB there: free space there or pick another directory with %s",
			dir, free>>20, reserved>>20, need>>20, errcode.Field("stagingDir"))
	}
	return fs, nil
}

// probeLeases checks that dir's filesystem grants file leases, by which
// vmsnap tells when QEMU has closed a staging file: a read lease on a file
// that is open for writing must be refused as a conflict (EAGAIN), not as
// unsupported.
func probeLeases(dir string) error {
	rw, err := os.CreateTemp(dir, ".vmsnap-probe-*.tmp")
	if err != nil {
		return stagingError(dir, err, "creating a file")
	}
	defer rw.Close()
	defer os.Remove(rw.Name())
	ro, err := os.Open(rw.Name())
	if err != nil {
		return stagingError(dir, err, "opening a file")
	}
	defer ro.Close()
	_, err = unix.FcntlInt(ro.Fd(), unix.F_SETLEASE, unix.F_RDLCK)
	if err == nil {
		_, _ = unix.FcntlInt(ro.Fd(), unix.F_SETLEASE, unix.F_UNLCK)
	}
	if !errors.Is(err, unix.EAGAIN) {
		return stagingError(dir, fmt.Errorf("its filesystem grants no file leases (%v), by which vmsnap tells that QEMU has closed a staging file: use one on ext4, xfs, btrfs or tmpfs", err), "checking the staging directory")
	}
	return nil
}

// keep counts one more (n 1) or one fewer (n -1) staging file of owner
// kept after its operation.
func keep(owner string, n int) {
	stagingSpace.Lock()
	defer stagingSpace.Unlock()
	if stagingSpace.kept == nil {
		stagingSpace.kept = map[string]int{}
	}
	if stagingSpace.kept[owner] += n; stagingSpace.kept[owner] <= 0 {
		delete(stagingSpace.kept, owner)
	}
}

func ownerName(owner string) string {
	if owner == "" {
		return "this process"
	}
	return owner
}

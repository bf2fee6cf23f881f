package snapshot

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Handles are a VM's QMP socket and disk overlay, each opened once by
// whoever checked it. Everything after uses these descriptors and never
// the paths again: a file swapped for a link or for another file after the
// check is not what is dialed or read.
type Handles struct {
	QMP  *os.File // the QMP socket: an O_PATH descriptor (qmp.DialFile)
	Disk *os.File // the qcow2 overlay, a regular file open for reading; nil without one
	// OpenRAMFile opens the VM's RAM file (a memory-file checkpoint), the
	// mem-path QEMU reports, the way the resolver opens the VM's other
	// files (the agent's: within the VM's container). Nil: the caller's
	// own path, as given.
	OpenRAMFile func(memPath string) (*os.File, error)
}

// Close closes the descriptors.
func (h *Handles) Close() error {
	var errs []error
	for _, f := range []*os.File{h.QMP, h.Disk} {
		if f != nil {
			errs = append(errs, f.Close())
		}
	}
	return errors.Join(errs...)
}

// handlesFor returns the Handles an operation (what) was given, checked
// against the paths they stand for, or else opens those paths as the
// caller's own (OpenLocal). done closes what handlesFor opened: given
// Handles stay their caller's.
func handlesFor(what string, given *Handles, qmpPath, diskPath string) (h *Handles, done func(), err error) {
	if given == nil {
		if h, err = OpenLocal(qmpPath, diskPath); err != nil {
			return nil, nil, err
		}
		return h, func() { h.Close() }, nil
	}
	if given.QMP == nil || (given.Disk != nil) != (diskPath != "") {
		return nil, nil, errcode.New(errcode.Internal, "the %s's opened files do not match its QMP socket and disk paths", what)
	}
	return given, func() {}, nil
}

// OpenLocal opens the disk overlay (if diskPath is not empty) and the QMP
// socket at paths the caller owns, as the CLI does for a VM of its own:
// each path is followed as given, once, and checked through what was
// opened, which is what the operation then uses.
func OpenLocal(qmpPath, diskPath string) (*Handles, error) {
	h := &Handles{}
	if diskPath != "" {
		d, err := openLocalDisk(diskPath)
		if err != nil {
			return nil, err
		}
		h.Disk = d
	}
	q, err := beneath.Path(qmpPath)
	if err != nil {
		h.Close()
		if errors.Is(err, fs.ErrPermission) {
			return nil, errcode.Wrap(errcode.QMPError, err, "not allowed to reach %s: run as a user who may open its directory", qmpPath)
		}
		return nil, noQEMU(qmpPath, err)
	}
	h.QMP = q
	if typ, err := beneath.Type(q); err != nil || typ != fs.ModeSocket {
		h.Close()
		if err == nil {
			err = fmt.Errorf("%s is %s, not a unix socket", qmpPath, beneath.TypeName(typ))
		}
		return nil, noQEMU(qmpPath, err)
	}
	return h, nil
}

// noQEMU is VM_NOT_FOUND for a QMP path with no socket, as qmp.Dial says it.
func noQEMU(p string, err error) error {
	return errcode.Wrap(errcode.VMNotFound, err,
		"no QEMU is listening at %s: check that the VM is running and was started with -qmp unix:%s,server=on,wait=off", p, p)
}

// openLocalDisk opens the overlay at p, which must be a regular file.
func openLocalDisk(p string) (*os.File, error) {
	f, err := beneath.Path(p)
	if err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "opening the disk overlay")
	}
	defer f.Close()
	if typ, err := beneath.Type(f); err != nil || typ != 0 {
		if err != nil {
			return nil, errcode.Wrap(errcode.Internal, err, "stat %s", p)
		}
		return nil, errcode.New(errcode.InvalidInput, "disk overlay %s is not a regular file (%s)", p, beneath.TypeName(typ))
	}
	// Through the descriptor checked: a FIFO or a device is never opened
	// for I/O.
	d, err := beneath.Reopen(f)
	if err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "opening the disk overlay")
	}
	return d, nil
}

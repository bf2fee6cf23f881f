package mounter

import (
	"context"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// TestFUSEDescriptorRoundTrip: the agent hands its /dev/fuse descriptor
// over and closes its own; what it gets back later is the same open file
// (a file status flag set on one shows on the other), not another open of
// /dev/fuse. Before any hand-over there is none to get.
func TestFUSEDescriptorRoundTrip(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	none, err := f.client.GetFUSE(ctx)
	if err != nil || none != nil {
		t.Fatalf("before a hand-over: %v, %v; want no descriptor and no error", none, err)
	}
	// A blocking descriptor (os.OpenFile would make it non-blocking),
	// closed once handed over, as an agent that exits does.
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	must(t, err)
	dev := os.NewFile(uintptr(fd), "/dev/fuse")
	must(t, f.client.PutFUSE(ctx, dev))
	dev.Close()
	first := getFUSE(t, f.client)
	if nonblocking(t, first) {
		t.Fatal("the descriptor handed back is non-blocking; the one handed over was not")
	}
	// Mark the open file: O_NONBLOCK lives in the open file description,
	// which every duplicate shares and no other open of /dev/fuse has.
	must(t, unix.SetNonblock(int(first.Fd()), true))
	first.Close()
	second := getFUSE(t, f.client)
	defer second.Close()
	if !nonblocking(t, second) {
		t.Fatal("the descriptors handed back are not duplicates of one open file")
	}
}

func getFUSE(t *testing.T, c Client) *os.File {
	t.Helper()
	f, err := c.GetFUSE(context.Background())
	must(t, err)
	if f == nil {
		t.Fatal("the mounter returned no descriptor after a hand-over")
	}
	return f
}

func nonblocking(t *testing.T, f *os.File) bool {
	t.Helper()
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	must(t, err)
	return fl&unix.O_NONBLOCK != 0
}

// TestFUSEDescriptorMustBeFUSE: the store keeps only /dev/fuse; a regular
// file or another device is refused, and the descriptor held before is
// kept.
func TestFUSEDescriptorMustBeFUSE(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	must(t, err)
	dev := os.NewFile(uintptr(fd), "/dev/fuse")
	defer dev.Close()
	must(t, f.client.PutFUSE(ctx, dev))
	must(t, unix.SetNonblock(fd, true)) // marks this open file
	for _, name := range []string{"/dev/null", "/proc/self/status"} {
		other, err := os.Open(name)
		must(t, err)
		wantCode(t, "handing over "+name, f.client.PutFUSE(ctx, other), errcode.InvalidInput)
		other.Close()
	}
	if kept := getFUSE(t, f.client); !nonblocking(t, kept) {
		t.Fatal("a refused hand-over replaced the descriptor held")
	} else {
		kept.Close()
	}
}

// TestRefusesADescriptorWithAnotherRequest: a descriptor on a publish is
// closed and refused, not kept.
func TestRefusesADescriptorWithAnotherRequest(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	must(t, err)
	defer dev.Close()
	_, err = f.client.call(context.Background(), request{Op: opPublish, Publish: &r}, dev)
	wantCode(t, "publish with a descriptor", err, errcode.InvalidInput)
	noMountsIn(t, f.root)
}

package fusefs

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// TestQEMUMapsAFileOfTheMount: the host's QEMU 7.2, which opens a
// share=off memory file O_RDWR, takes a file of the mount as guest RAM, and
// the guest's physical memory is the file's bytes.
func TestQEMUMapsAFileOfTheMount(t *testing.T) {
	qemu, err := exec.LookPath(guest.QEMUBinary)
	if err != nil {
		guest.SkipOrFail(t, "real-QEMU", guest.QEMUBinary+" is not installed (apt-get install qemu-system-x86)")
	}
	qemuMapsTheFile(t, qemu, nil, nil, "share=off", os.O_RDWR)
}

// TestQEMU10MapsAFileOfTheMount: QEMU 10 with readonly=on,rom=off opens the
// file O_RDONLY and maps it privately, writable.
func TestQEMU10MapsAFileOfTheMount(t *testing.T) {
	bin, args, env := guest.QEMU10Command(t)
	qemuMapsTheFile(t, bin, args, env, "share=off,readonly=on,rom=off", os.O_RDONLY)
}

// qemuMapsTheFile starts QEMU (stopped: -S) with a file of the mount as its
// RAM backend, dumps guest memory and compares it with the file, and checks
// the access mode QEMU opened the file with.
func qemuMapsTheFile(t *testing.T, qemu string, args, env []string, backend string, accmode int) {
	tree, _ := newTestTree(t)
	m := mountTree(t, tree, nil)
	dir := t.TempDir()
	qmp := filepath.Join(dir, "qmp.sock")
	cmd := exec.Command(qemu, append(args, "-accel", "tcg", "-nodefaults", "-display", "none", "-S", "-m", "4M",
		"-object", "memory-backend-file,id=ram0,mem-path="+m.file("ram")+","+backend+",size=4M",
		"-machine", "pc,memory-backend=ram0", "-qmp", "unix:"+qmp+",server=on,wait=off")...)
	cmd.Env = append(os.Environ(), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dump := filepath.Join(dir, "dump")
	const from = 1 << 20 // RAM above the BIOS areas
	var err error
	for {
		_, err = guest.QMP(ctx, qmp, "pmemsave", map[string]any{"val": from, "size": fileSize - from, "filename": dump})
		if err == nil || ctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond) // QEMU is still starting
	}
	if err != nil {
		t.Fatalf("pmemsave: %v (QEMU said %q)", err, stderr.String())
	}
	got, err := os.ReadFile(dump)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, fileSize-from)
	tree.ram.ReadAt(want, from)
	if !bytes.Equal(got, want) {
		t.Fatalf("QEMU's guest memory (%s) is not the file's bytes (%s)", shortSum(got), shortSum(want))
	}
	if flags := openFlags(t, cmd.Process.Pid, m.file("ram")); flags&3 != accmode {
		t.Errorf("QEMU opened the file with flags %#o, want access mode %d", flags, accmode)
	}
}

// openFlags are the open flags of pid's descriptor of path (fdinfo).
func openFlags(t *testing.T, pid int, path string) int {
	fds, _ := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/fd/*")
	for _, fd := range fds {
		if target, _ := os.Readlink(fd); target != path {
			continue
		}
		info, err := os.ReadFile(strings.Replace(fd, "/fd/", "/fdinfo/", 1))
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(l, "flags:"); ok {
				flags, _ := strconv.ParseInt(strings.TrimSpace(v), 8, 64)
				return int(flags)
			}
		}
	}
	t.Fatalf("QEMU holds no descriptor of %s", path)
	return 0
}

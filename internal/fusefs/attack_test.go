package fusefs

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// An attack is one way a hostile process could try to change a file of the
// mount, and the errno it must end with. 0: the kernel and the server let it
// happen (a private mapping's copy-on-write), and it must change nothing
// anyone else sees.
type attack struct {
	name string
	want unix.Errno
	run  func(path string) error
}

var attacks = []attack{
	{name: "write", want: unix.EROFS, run: func(p string) error {
		return withFd(p, unix.O_RDWR, func(fd int) error { _, err := unix.Write(fd, []byte("EVIL")); return err })
	}},
	{name: "pwrite", want: unix.EROFS, run: func(p string) error {
		return withFd(p, unix.O_RDWR, func(fd int) error { _, err := unix.Pwrite(fd, []byte("EVIL"), 8192); return err })
	}},
	{name: "pwrite O_DIRECT", want: unix.EROFS, run: directWrite},
	{name: "ftruncate", want: unix.EPERM, run: func(p string) error {
		return withFd(p, unix.O_RDWR, func(fd int) error { return unix.Ftruncate(fd, 4096) })
	}},
	{name: "truncate", want: unix.EPERM, run: func(p string) error { return unix.Truncate(p, 0) }},
	{name: "open O_TRUNC", want: unix.EPERM, run: func(p string) error { return withFd(p, unix.O_WRONLY|unix.O_TRUNC, func(int) error { return nil }) }},
	{name: "fallocate punch", want: unix.EPERM, run: func(p string) error {
		return withFd(p, unix.O_RDWR, func(fd int) error {
			return unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, 1<<20)
		})
	}},
	{name: "fallocate grow", want: unix.EPERM, run: func(p string) error {
		return withFd(p, unix.O_RDWR, func(fd int) error { return unix.Fallocate(fd, 0, 0, 2*fileSize) })
	}},
	{name: "MAP_SHARED write", want: unix.ENODEV, run: func(p string) error { return mapAndWrite(p, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED, false) }},
	{name: "MAP_SHARED mprotect write", want: unix.ENODEV, run: func(p string) error { return mapAndWrite(p, unix.PROT_READ, unix.MAP_SHARED, true) }},
	{name: "MAP_PRIVATE write", run: func(p string) error { return mapAndWrite(p, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE, false) }},
	{name: "copy_file_range", want: unix.EROFS, run: copyInto},
	{name: "sendfile", want: unix.EROFS, run: sendfileInto},
	{name: "setxattr", want: unix.EPERM, run: func(p string) error { return unix.Setxattr(p, "user.evil", []byte("1"), 0) }},
	{name: "removexattr", want: unix.EPERM, run: func(p string) error { return unix.Removexattr(p, "user.evil") }},
	{name: "chmod", want: unix.EPERM, run: func(p string) error { return unix.Chmod(p, 0o666) }},
	{name: "chown", want: unix.EPERM, run: func(p string) error { return unix.Chown(p, 1000, 1000) }},
	{name: "utimes", want: unix.EPERM, run: func(p string) error { return unix.UtimesNano(p, []unix.Timespec{{Sec: 1}, {Sec: 1}}) }},
	{name: "rename", want: unix.EPERM, run: func(p string) error { return unix.Rename(p, p+".moved") }},
	{name: "unlink", want: unix.EPERM, run: func(p string) error { return unix.Unlink(p) }},
	{name: "link", want: unix.EPERM, run: func(p string) error { return unix.Link(p, p+".link") }},
	{name: "create", want: unix.EPERM, run: func(p string) error {
		return withFd(p+".new", unix.O_CREAT|unix.O_WRONLY, func(int) error { return nil })
	}},
	{name: "mkdir", want: unix.EPERM, run: func(p string) error { return unix.Mkdir(p+".dir", 0o755) }},
	{name: "symlink", want: unix.EPERM, run: func(p string) error { return unix.Symlink("/etc/passwd", p+".sym") }},
	{name: "rmdir", want: unix.EPERM, run: func(p string) error { return unix.Rmdir(filepath.Dir(p)) }},
}

func withFd(path string, flags int, f func(fd int) error) error {
	fd, err := unix.Open(path, flags|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return fmt.Errorf("open: %w", err)
	}
	defer unix.Close(fd)
	return f(fd)
}

// mapAndWrite maps the file's first MiB from an O_RDWR descriptor, as QEMU
// 7.2 does, and writes into every page of it (after mprotect, if asked).
func mapAndWrite(path string, prot, flags int, mprotect bool) error {
	return withFd(path, unix.O_RDWR, func(fd int) error {
		m, err := unix.Mmap(fd, 0, 1<<20, prot, flags)
		if err != nil {
			return fmt.Errorf("mmap: %w", err)
		}
		defer unix.Munmap(m)
		if mprotect {
			if err := unix.Mprotect(m, unix.PROT_READ|unix.PROT_WRITE); err != nil {
				return fmt.Errorf("mprotect: %w", err)
			}
		}
		for i := 0; i < len(m); i += 4096 {
			copy(m[i:], "EVIL")
		}
		return unix.Msync(m, unix.MS_SYNC)
	})
}

func directWrite(path string) error {
	return withFd(path, unix.O_RDWR|unix.O_DIRECT, func(fd int) error {
		buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		if err != nil {
			return err
		}
		defer unix.Munmap(buf)
		copy(buf, "EVIL")
		_, err = unix.Pwrite(fd, buf, 0)
		return err
	})
}

// copyInto copies the file's second page over its first, inside the mount
// (the one case the kernel sends COPY_FILE_RANGE to the server).
func copyInto(path string) error {
	return withFd(path, unix.O_RDONLY, func(in int) error {
		return withFd(path, unix.O_RDWR, func(out int) error {
			inOff, outOff := int64(4096), int64(0)
			_, err := unix.CopyFileRange(in, &inOff, out, &outOff, 4096, 0)
			return err
		})
	})
}

func sendfileInto(path string) error {
	src, err := os.CreateTemp("", "evil")
	if err != nil {
		return err
	}
	defer os.Remove(src.Name())
	defer src.Close()
	src.WriteString(strings.Repeat("EVIL", 1024))
	return withFd(path, unix.O_RDWR, func(out int) error {
		off := int64(0)
		_, err := unix.Sendfile(out, int(src.Fd()), &off, 4096)
		return err
	})
}

// runAttack is the attacker child: it prints the errno the attack ended
// with (0: it went through).
func runAttack(name, path string) error {
	for _, a := range attacks {
		if a.name == name {
			var errno unix.Errno
			err := a.run(path)
			if err != nil && !errors.As(err, &errno) {
				return err
			}
			fmt.Printf("%d %v\n", int(errno), err)
			return nil
		}
	}
	return fmt.Errorf("no attack %q", name)
}

// victim is a process that maps the file as QEMU 7.2 maps guest RAM
// (O_RDWR, MAP_PRIVATE), reads all of it, and prints the hash of what it
// sees, again on each line it reads.
func victim(path string) error {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	m, err := unix.Mmap(fd, 0, fileSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		return err
	}
	fmt.Println(shortSum(m))
	for sc := bufio.NewScanner(os.Stdin); sc.Scan(); {
		fmt.Println(shortSum(m))
	}
	return nil
}

// attackSuite runs every attack, each in its own process, against the
// mount's file while a victim maps it, and returns what went wrong: an
// attack that was not refused, or anything that changed what the victim,
// a later reader or the backing file sees.
func attackSuite(t *testing.T, directIO bool) []string {
	tree, _ := newTestTree(t)
	m := mountTree(t, tree, func(c *Conn) { c.directIOOnWrite = directIO })
	path := m.file("ram")
	want := fileSum(t, tree.ram.Name())
	if got := fileSum(t, path); got != want {
		t.Fatalf("the mount reads %s, the backing file has %s", got, want)
	}
	_, victimIn, victimOut := child(t, "victim", path)
	if got := line(t, victimOut); got != want {
		t.Fatalf("the victim's mapping reads %s, want %s", got, want)
	}
	var problems []string
	seen := map[string]string{"victim": want, "reader": want, "backing": want}
	for _, a := range attacks {
		_, _, out := child(t, "attack", a.name+" "+path)
		result := line(t, out)
		t.Logf("%-26s %s", a.name, result)
		if !strings.HasPrefix(result, fmt.Sprintf("%d ", int(a.want))) {
			problems = append(problems, fmt.Sprintf("%s: ended with %q, want errno %d (%v)", a.name, result, int(a.want), a.want))
		}
		fmt.Fprintln(victimIn, "check")
		now := map[string]string{"victim": line(t, victimOut), "reader": fileSum(t, path), "backing": fileSum(t, tree.ram.Name())}
		for _, who := range []string{"victim", "reader", "backing"} {
			if now[who] != seen[who] {
				problems = append(problems, fmt.Sprintf("%s: the %s's bytes changed (%s, were %s)", a.name, who, now[who], seen[who]))
			}
		}
		seen = now
	}
	return problems
}

// TestAttacksChangeNothing performs every write attack from its own process
// against a file a victim maps privately: each is refused (but a private
// mapping's own copy-on-write), and no byte anyone sees changes.
func TestAttacksChangeNothing(t *testing.T) {
	for _, p := range attackSuite(t, true) {
		t.Error(p)
	}
}

// TestAttackSuiteCatchesSharedMappings runs the suite against a server that
// does not answer write opens with DIRECT_IO: then a refused write(2) (the
// kernel copies it into the page cache before the server refuses it) and a
// MAP_SHARED writer change the page cache the victim maps. The suite must
// see both, or it proves nothing.
func TestAttackSuiteCatchesSharedMappings(t *testing.T) {
	problems := attackSuite(t, false)
	for _, p := range problems {
		t.Log(p)
	}
	for _, hole := range []string{"write: the victim's bytes changed", "MAP_SHARED write: the victim's bytes changed"} {
		if !slices.ContainsFunc(problems, func(p string) bool { return strings.HasPrefix(p, hole) }) {
			t.Errorf("without DIRECT_IO on write opens the suite should report %q, and did not", hole)
		}
	}
}

package fusefs

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// reader is a child that reads len bytes at off of a file (arg "PATH OFF
// LEN [direct]") and prints their hash. direct: with O_DIRECT, a
// synchronous request that a signal interrupts (a page-cache read is sent
// in the background and never interrupted).
func reader(arg string) error {
	f := strings.Fields(arg)
	if len(f) < 3 || len(f) > 4 {
		return fmt.Errorf("reader: want PATH OFF LEN [direct], got %q", arg)
	}
	flags := os.O_RDONLY
	if len(f) == 4 {
		flags |= syscall.O_DIRECT
	}
	off, err1 := strconv.ParseInt(f[1], 10, 64)
	n, err2 := strconv.Atoi(f[2])
	if err1 != nil || err2 != nil {
		return fmt.Errorf("reader: %q", arg)
	}
	file, err := os.OpenFile(f[0], flags, 0)
	if err != nil {
		return err
	}
	defer file.Close()
	b := make([]byte, n)
	if _, err := file.ReadAt(b, off); err != nil {
		return err
	}
	fmt.Println(shortSum(b))
	return nil
}

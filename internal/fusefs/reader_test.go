package fusefs

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// reader is a child that reads len bytes at off of a file (arg "PATH OFF
// LEN") and prints their hash.
func reader(arg string) error {
	f := strings.Fields(arg)
	if len(f) != 3 {
		return fmt.Errorf("reader: want PATH OFF LEN, got %q", arg)
	}
	off, err1 := strconv.ParseInt(f[1], 10, 64)
	n, err2 := strconv.Atoi(f[2])
	if err1 != nil || err2 != nil {
		return fmt.Errorf("reader: %q", arg)
	}
	file, err := os.Open(f[0])
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

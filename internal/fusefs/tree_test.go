package fusefs

import (
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// The test tree: /p/vol/ram and /p/vol/other, files backed by files in a
// temp dir. block, when set, decides whether a Read of ram waits.
const (
	nodeP     = 2
	nodeVol   = 3
	nodeRAM   = 4
	nodeOther = 5
	fileSize  = 4 << 20
)

type testTree struct {
	ram, other *os.File
	// block is called before each Read of ram; an error is the Read's.
	block func(ctx context.Context, off int64) error
}

// newTestTree writes two files of random bytes into dir and serves them.
func newTestTree(t testing.TB) (*testTree, string) {
	t.Helper()
	dir := t.TempDir()
	for _, name := range []string{"ram", "other"} {
		b := make([]byte, fileSize)
		rand.Read(b)
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	tree, err := openTestTree(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tree.ram.Close(); tree.other.Close() })
	return tree, dir
}

// openTestTree serves the files newTestTree wrote into dir.
func openTestTree(dir string) (*testTree, error) {
	ram, err := os.Open(filepath.Join(dir, "ram"))
	if err != nil {
		return nil, err
	}
	other, err := os.Open(filepath.Join(dir, "other"))
	if err != nil {
		ram.Close()
		return nil, err
	}
	return &testTree{ram: ram, other: other}, nil
}

var testAttrs = map[uint64]Attr{
	nodeP: {Node: nodeP, Kind: Dir}, nodeVol: {Node: nodeVol, Kind: Dir},
	nodeRAM: {Node: nodeRAM, Kind: File, Size: fileSize}, nodeOther: {Node: nodeOther, Kind: File, Size: fileSize},
}

var testDirs = map[uint64][]Entry{
	rootNode: {{Name: "p", Attr: testAttrs[nodeP]}},
	nodeP:    {{Name: "vol", Attr: testAttrs[nodeVol]}},
	nodeVol:  {{Name: "ram", Attr: testAttrs[nodeRAM]}, {Name: "other", Attr: testAttrs[nodeOther]}},
}

func (tt *testTree) Lookup(parent uint64, name string) (Attr, error) {
	for _, e := range testDirs[parent] {
		if e.Name == name {
			return e.Attr, nil
		}
	}
	return Attr{}, unix.ENOENT
}

func (tt *testTree) Readdir(dir uint64) ([]Entry, error) {
	if e, ok := testDirs[dir]; ok {
		return e, nil
	}
	return nil, unix.ENOTDIR
}

func (tt *testTree) Attr(node uint64) (Attr, error) {
	if a, ok := testAttrs[node]; ok {
		return a, nil
	}
	return Attr{}, unix.ENOENT
}

func (tt *testTree) Read(ctx context.Context, node uint64, dst []byte, off int64) (int, error) {
	f := tt.other
	if node == nodeRAM {
		f = tt.ram
		if tt.block != nil {
			if err := tt.block(ctx, off); err != nil {
				return 0, err
			}
		}
	} else if node != nodeOther {
		return 0, unix.EISDIR
	}
	return f.ReadAt(dst, off)
}

package cluster

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// Paths inside the QEMU test image.
const (
	QEMUImageKernel = "/vm/guest/vmlinuz"
	QEMUImageInitrd = "/vm/guest/initrd"
	// QEMUImageBaseDir holds QEMUImageBaseDisk, the backing file of the
	// guest's qcow2 overlays (an empty 64 MiB qcow2).
	QEMUImageBaseDir  = "/vm/base"
	QEMUImageBaseDisk = QEMUImageBaseDir + "/base.qcow2"
	// VMSnapPath is where both images hold vmsnap (on their PATH).
	VMSnapPath = "/usr/local/bin/vmsnap"
)

// VMSnapBinary builds cmd/vmsnap into a directory of t: static (CGO
// disabled), as it runs in images without a C library. The Go build cache
// makes every build after the first a link.
func VMSnapBinary(t testing.TB) string {
	t.Helper()
	root, err := guest.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "vmsnap")
	cmd := exec.Command("go", "build", "-trimpath", "-o", bin, "./cmd/vmsnap")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/vmsnap: %v\n%s", err, out)
	}
	return bin
}

// contentName names an image by a digest of its files, so that a changed
// binary is never confused with the image of an older one.
func contentName(repo string, files []containerd.File) (string, error) {
	h := sha256.New()
	sort.Slice(files, func(i, j int) bool { return files[i].Path < files[j].Path })
	for _, f := range files {
		data := f.Data
		if f.HostPath != "" {
			b, err := os.ReadFile(f.HostPath)
			if err != nil {
				return "", err
			}
			data = b
		}
		s := sha256.Sum256(data)
		fmt.Fprintf(h, "%s %o %x\n", f.Path, f.Mode, s)
	}
	return repo + ":" + hex.EncodeToString(h.Sum(nil))[:16], nil
}

// ImportFiles builds an image of files named repo:CONTENT-DIGEST, imports
// it into the node's containerd and returns its name.
func (c *Cluster) ImportFiles(t testing.TB, repo string, files []containerd.File, cfg containerd.ImageConfig) string {
	t.Helper()
	name, err := contentName(repo, files)
	if err != nil {
		t.Fatal(err)
	}
	tarball, err := containerd.BuildImageTar(name, files, cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.ImportImageTar(t, name, tarball)
	return name
}

// ImportVMSnapImage imports the vmsnap image: the static binary alone, on
// PATH, as the manifests' Image.
func (c *Cluster) ImportVMSnapImage(t testing.TB, vmsnap string) string {
	t.Helper()
	return c.ImportFiles(t, "vmsnap.test/vmsnap", []containerd.File{{Path: VMSnapPath, HostPath: vmsnap}},
		containerd.ImageConfig{Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin"}})
}

// ImportQEMUImage imports the QEMU test image: Debian's qemu-system-x86_64
// and qemu-img with the shared libraries they load and QEMU's firmware, the
// test guest's kernel and initramfs, an empty base disk, vmsnap (for
// -incoming exec: and the launcher) and busybox as /bin/sh.
func (c *Cluster) ImportQEMUImage(t testing.TB, vmsnap string) string {
	t.Helper()
	kernel, initrd := guest.Assets(t)
	files := []containerd.File{
		{Path: QEMUImageKernel, HostPath: kernel, Mode: 0o644},
		{Path: QEMUImageInitrd, HostPath: initrd, Mode: 0o644},
		{Path: VMSnapPath, HostPath: vmsnap},
		{Path: "/bin/sh", HostPath: "/bin/busybox"},
		{Path: "/bin/busybox", HostPath: "/bin/busybox"},
		{Path: "/etc/passwd", Data: []byte("root:x:0:0::/:/bin/sh\nqemu:x:65532:65532::/:/bin/sh\n"), Mode: 0o644},
		{Path: "/etc/group", Data: []byte("root:x:0:\nqemu:x:65532:\n"), Mode: 0o644},
	}
	base := filepath.Join(t.TempDir(), "base.qcow2")
	if out, err := exec.Command(guest.QEMUImgBinary, "create", "-q", "-f", "qcow2", base, "64M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v\n%s", err, out)
	}
	files = append(files, containerd.File{Path: QEMUImageBaseDisk, HostPath: base, Mode: 0o444})
	var bins []string
	for _, name := range []string{guest.QEMUBinary, guest.QEMUImgBinary} {
		bin, err := exec.LookPath(name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		files = append(files, containerd.File{Path: "/usr/bin/" + name, HostPath: bin})
		bins = append(bins, bin)
	}
	// Debian's QEMU loads TCG from a module, at its build-time path.
	modules, _ := filepath.Glob(qemuModules)
	if len(modules) == 0 {
		t.Fatalf("no QEMU accelerator modules %s", qemuModules)
	}
	for _, m := range modules {
		files = append(files, containerd.File{Path: m, HostPath: m, Mode: 0o644})
	}
	for _, bin := range append(bins, modules...) {
		libs, err := sharedLibraries(bin)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range libs {
			files = append(files, containerd.File{Path: l, HostPath: l})
		}
	}
	// QEMU's data files, and the BIOS Debian ships apart (seabios), where
	// QEMU looks for them.
	firmware, _ := filepath.Glob("/usr/share/qemu/*")
	bios, _ := filepath.Glob("/usr/share/seabios/*")
	firmware = append(firmware, bios...)
	for _, f := range firmware {
		if fi, err := os.Stat(f); err == nil && fi.Mode().IsRegular() { // symlinks followed
			files = append(files, containerd.File{Path: f, HostPath: f, Mode: 0o644})
		}
	}
	// The libraries are where ldd found them; the loader has no cache here.
	return c.ImportFiles(t, "vmsnap.test/qemu", dedupe(files), containerd.ImageConfig{
		Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin", "LD_LIBRARY_PATH=/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu"}})
}

// qemuModules are the accelerator modules of Debian's QEMU.
const qemuModules = "/usr/lib/x86_64-linux-gnu/qemu/accel-*.so"

var lddPath = regexp.MustCompile(`(/[^ ]+) \(0x`)

// sharedLibraries lists the absolute paths of the libraries ldd says bin
// loads, the dynamic loader included.
func sharedLibraries(bin string) ([]string, error) {
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %v", bin, err)
	}
	var libs []string
	for _, line := range strings.Split(string(out), "\n") {
		if m := lddPath.FindStringSubmatch(line); m != nil {
			libs = append(libs, m[1])
		}
	}
	if len(libs) == 0 {
		return nil, fmt.Errorf("ldd %s listed no libraries:\n%s", bin, out)
	}
	return libs, nil
}

func dedupe(files []containerd.File) []containerd.File {
	seen := map[string]bool{}
	var out []containerd.File
	for _, f := range files {
		if !seen[f.Path] {
			seen[f.Path] = true
			out = append(out, f)
		}
	}
	return out
}

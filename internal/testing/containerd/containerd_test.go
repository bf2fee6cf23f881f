package containerd

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
)

// TestHarness starts a containerd, runs a labelled container with a bind
// mount, runs a command to completion with its output, deletes and replaces.
func TestHarness(t *testing.T) {
	t0 := time.Now()
	d := Start(t)
	t.Logf("containerd up in %v", time.Since(t0))
	ctx := d.Context(context.Background())

	uid := NewPodUID()
	t1 := time.Now()
	c := d.Create(t, PodContainer{PodUID: uid, Name: "qemu"})
	t.Logf("container created and started in %v", time.Since(t1))
	st, err := c.Task.Status(ctx)
	if err != nil || st.Status != client.Running {
		t.Fatalf("task status %v, %v; want running", st.Status, err)
	}
	info, err := c.Container.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{LabelPodUID: uid, LabelContainerName: "qemu", LabelPodName: "vm", LabelPodNamespace: "default"} {
		if info.Labels[k] != v {
			t.Errorf("label %s = %q, want %q", k, info.Labels[k], v)
		}
	}
	list, err := d.Client.Containers(ctx, `labels."`+LabelPodUID+`"=="`+uid+`"`)
	if err != nil || len(list) != 1 || list[0].ID() != c.ID {
		t.Fatalf("label filter found %d containers, %v", len(list), err)
	}

	// The bind mount is live: the container writes into the host dir.
	var out bytes.Buffer
	code := d.Run(t, PodContainer{
		HostDir: c.HostDir,
		Args:    []string{"/bin/busybox", "sh", "-c", "echo hello > /run/vm/from-container; echo out; id -u"},
		Stdout:  &out, Stderr: &out,
	}, 30*time.Second)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, out.String())
	}
	if got := out.String(); !strings.Contains(got, "out\n0\n") {
		t.Errorf("output %q", got)
	}
	if b, err := os.ReadFile(filepath.Join(c.HostDir, "from-container")); err != nil || string(b) != "hello\n" {
		t.Errorf("file written in the container: %q, %v", b, err)
	}
	code = d.Run(t, PodContainer{Args: []string{"/bin/busybox", "sh", "-c", "exit 7"}}, 30*time.Second)
	if code != 7 {
		t.Errorf("exit status %d, want 7", code)
	}

	n := d.Replace(t, c)
	if n.ID == c.ID || n.Labels[LabelPodUID] != uid || n.HostDir != c.HostDir {
		t.Fatalf("replacement %s labels %v dir %s", n.ID, n.Labels, n.HostDir)
	}
	if _, err := d.Client.LoadContainer(ctx, c.ID); err == nil {
		t.Errorf("old container %s still exists", c.ID)
	}
	if len(shimPIDs(d.Address)) == 0 {
		t.Errorf("no shim found for %s", d.Address)
	}
}

const victimEnv = "VMSNAP_TESTCONTAINERD_VICTIM"

// TestVictim is run by TestKilledBinaryIsCleanedUp in a child process, which
// is then killed.
func TestVictim(t *testing.T) {
	if os.Getenv(victimEnv) != "1" {
		t.Skip("run by TestKilledBinaryIsCleanedUp only")
	}
	d := Start(t)
	c := d.Create(t, PodContainer{PodUID: NewPodUID(), HostDir: "-"})
	fmt.Printf("READY %s %d %d\n", d.Dir, d.cmd.Process.Pid, c.Task.Pid())
	time.Sleep(time.Minute)
}

// TestKilledBinaryIsCleanedUp kills a test binary that runs a containerd
// and a container: containerd dies with it, and the next Start removes the
// shim, the container and the directory it left.
func TestKilledBinaryIsCleanedUp(t *testing.T) {
	Require(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestVictim$", "-test.v")
	cmd.Env = append(os.Environ(), victimEnv+"=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var dir string
	var ctrdPID, ctrPID int
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if _, err := fmt.Sscanf(sc.Text(), "READY %s %d %d", &dir, &ctrdPID, &ctrPID); err == nil {
			break
		}
	}
	if dir == "" {
		cmd.Wait()
		t.Fatal("victim did not get ready")
	}
	go io.Copy(io.Discard, out)
	address := filepath.Join(dir, "c.sock")
	if len(shimPIDs(address)) != 1 || !alive(ctrPID) {
		t.Fatalf("victim: shims %v, container process alive %v", shimPIDs(address), alive(ctrPID))
	}
	cmd.Process.Kill()
	cmd.Wait()

	deadline := time.Now().Add(5 * time.Second)
	for alive(ctrdPID) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if alive(ctrdPID) {
		t.Fatalf("containerd %d outlived its test binary", ctrdPID)
	}
	if !alive(ctrPID) {
		t.Logf("the container's process died with the test binary")
	}
	reapStale(t)
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s still there: %v", dir, err)
	}
	if pids := shimPIDs(address); len(pids) > 0 {
		t.Errorf("shims still running: %v", pids)
	}
	deadline = time.Now().Add(5 * time.Second)
	for alive(ctrPID) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if alive(ctrPID) {
		t.Errorf("the container's process %d still runs", ctrPID)
	}
}

// alive reports whether pid is a running (not zombie) process.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

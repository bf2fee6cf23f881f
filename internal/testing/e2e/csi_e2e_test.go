package e2e

// The CSI path on a real QEMU 10: a memory-file snapshot published by the
// agent's CSI plugin (the real mounter, the plugin's real sockets, a
// kubelet-like client) into two pods' volumes, and two QEMU 10 clones
// restored from the published file, read-only and shared.

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/agent/csi"
	"github.com/vmsnap/vmsnap/agent/mounter"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/csinode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// noVMs is a resolver for an agent that only publishes.
type noVMs struct{}

func (noVMs) Resolve(context.Context, agent.VMRef) (*agent.Resolved, error) {
	return nil, errcode.New(errcode.VMNotFound, "this test's agent finds no VMs")
}

func (noVMs) Watch(ctx context.Context) (<-chan agent.Gone, error) {
	ch := make(chan agent.Gone)
	go func() { <-ctx.Done(); close(ch) }()
	return ch, nil
}

// startPublishingAgent runs an agent in this process that reads layouts
// under layouts, and the CSI node around it; it returns the node and a
// client of the agent's API (this process is on the node: an admin).
func startPublishingAgent(t *testing.T, layouts string) (*csinode.Node, *agent.Client, string) {
	t.Helper()
	stateDir := t.TempDir()
	sock := filepath.Join(guest.FreeShortDir(t), "agent.sock")
	srv, err := agent.New(context.Background(), agent.Config{Socket: sock, StateDir: stateDir, Resolver: noVMs{}, LayoutRoot: layouts,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	n := csinode.Start(t, filepath.Join(stateDir, "ram"), func(m string) csi.Publisher { return srv.CSIPublisher(mounter.Client{Socket: m}) })
	client, err := agent.NewClient("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	return n, client, stateDir
}

func TestCSIE2EQEMU10ClonesRestoreFromThePublishedFile(t *testing.T) {
	root := guest.QEMU10(t)
	guest.Assets(t)
	dir := guest.FreeShortDir(t)
	shm := shmDir(t)
	overlay := guest.NewDisk(t, dir)
	const memMB = 256
	src := guest.Start(t, guest.Options{Disk: overlay, Dir: dir, QEMURoot: root, ExtraArgs: fileRAMArgs(filepath.Join(shm, "src.ram"), memMB)})
	if _, err := src.WaitReady(waitCtx(t)); err != nil {
		t.Fatalf("QEMU 10 guest did not boot: %v\n%s", err, src.SerialTail(20))
	}
	before, err := src.WaitStatus(waitCtx(t), func(guest.Status) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	layouts := t.TempDir()
	store := filepath.Join(layouts, "tenant-a")
	last, _ := src.LastStatus()
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+"/vm:1", "--mode", "snapshot",
		"--disk", overlay, "--disk-image", "oci:"+store+"/disk:1")
	if cp.VMState.Format != vmspec.FormatMemoryFile {
		t.Fatalf("QEMU 10 with a shared RAM file: format %q", cp.VMState.Format)
	}
	printed, _ := src.LastStatus()
	after, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > printed.Counter })
	if err != nil {
		t.Fatalf("the source does not run on after its snapshot: %v", err)
	}
	src.Kill()

	n, client, stateDir := startPublishingAgent(t, layouts)
	var files []string
	var fileBefore string
	for i, name := range []string{"a.qcow2", "b.qcow2"} {
		v := n.NewVolume(t)
		if err := n.Publish(v, "tenant-a", cp.VMState.Image); err != nil {
			t.Fatal(err)
		}
		// The arguments the pod's launcher derives for the file as it sees it.
		op, err := client.Prepare(waitCtx(t), api.PrepareRequest{Image: cp.VMState.Image, Namespace: "tenant-a", QEMUDir: v.Target})
		if err == nil {
			op, err = client.Wait(waitCtx(t), op.ID, nil)
		}
		if err == nil {
			err = agent.Result(op)
		}
		if err != nil {
			t.Fatal(err)
		}
		p := op.Prepare
		if p.FetchedBytes != 0 || !strings.Contains(strings.Join(p.QEMUArgs, " "), "mem-path="+v.Target+"/") ||
			!strings.Contains(strings.Join(p.QEMUArgs, " "), "readonly=on,rom=off") {
			t.Fatalf("clone %d: the published image's arguments %q (fetched %d): want the target's file, read-only, nothing fetched", i, p.QEMUArgs, p.FetchedBytes)
		}
		files = append(files, p.MemoryFile)
		if i == 0 {
			fileBefore = fileDigest(t, p.MemoryFile)
		}
		tdir := targetDir(t, dir)
		target := guest.Start(t, guest.Options{Dir: tdir, Incoming: true, QEMURoot: root, Disk: restoreDisk(t, cp, tdir, name), ExtraArgs: p.QEMUArgs})
		rs := cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image)
		if rs.VMState == nil || !rs.VMState.VMRunning {
			t.Fatalf("clone %d: restore %+v", i, rs)
		}
		assertResumed(t, target, before, last.Counter+1, after.Counter)
	}
	// One file under both volumes, the cache's: the clones share its pages,
	// and running on it changed none of its bytes.
	var a, b, c unix.Stat_t
	cacheFile := filepath.Join(agent.RAMCacheDir(stateDir, "tenant-a"), filepath.Base(files[0]))
	if unix.Stat(files[0], &a) != nil || unix.Stat(files[1], &b) != nil || unix.Stat(cacheFile, &c) != nil || a.Ino != c.Ino || b.Ino != c.Ino {
		t.Errorf("the clones' files %s and %s are not the cache's %s (inodes %d, %d, %d)", files[0], files[1], cacheFile, a.Ino, b.Ino, c.Ino)
	}
	if fileDigest(t, cacheFile) != fileBefore {
		t.Error("the published RAM file changed while two guests ran on it")
	}
}

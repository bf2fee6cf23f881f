package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/agent/mounter"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guard"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// TestMounterRefusesBadPaths: paths that are not absolute and clean are a
// usage error before anything is opened.
func TestMounterRefusesBadPaths(t *testing.T) {
	dir := t.TempDir()
	for _, args := range [][]string{
		{"--socket", dir + "/run/m.sock", "--kubelet-pods-dir", dir, "--publication-root", "relative/root"},
		{"--socket", dir + "/run/m.sock", "--kubelet-pods-dir", dir + "/../x", "--publication-root", dir},
		{"--socket", dir + "/run/m.sock", "--kubelet-pods-dir", dir, "--publication-root", "/"},
	} {
		if _, code := cli(t, append([]string{"mounter"}, args...)...); code != errcode.Usage.ExitStatus() {
			t.Errorf("vmsnap mounter %s: exit %d, want %d (USAGE)", strings.Join(args, " "), code, errcode.Usage.ExitStatus())
		}
	}
}

// TestMounterCommandPublishes: vmsnap mounter serves the agent's client
// until it is stopped, and then exits 0 with its socket gone.
func TestMounterCommandPublishes(t *testing.T) {
	if os.Geteuid() != 0 {
		guest.SkipOrFail(t, "mounter", "bind mounts need root")
	}
	dir := t.TempDir()
	pods, pub, sock := dir+"/pods", dir+"/pub", dir+"/run/m.sock"
	uid := "0b6a4a5e-35c1-4a7c-9f0e-6a2d3c1b9e11"
	r := mounter.PublishRequest{VolumeID: mounter.VolumeHandle(uid, "ram"), PodUID: uid, ReadOnly: true}
	r.Target = filepath.Join(pods, uid, "volumes/kubernetes.io~csi/ram/mount")
	r.Source = filepath.Join(pub, r.VolumeID)
	for _, d := range []string{filepath.Dir(r.Target), r.Source} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(r.Source+"/marker", []byte("published"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(r.Target, unix.MNT_DETACH) })
	ctx, cancel := context.WithCancel(context.Background())
	exit := make(chan int, 1)
	var stderr bytes.Buffer
	go func() {
		exit <- run(ctx, []string{"mounter", "--socket", sock, "--kubelet-pods-dir", pods, "--publication-root", pub}, &bytes.Buffer{}, &stderr)
	}()
	client := mounter.Client{Socket: sock}
	err := guard.Within(t, time.Minute, 1<<30, "publishing through vmsnap mounter", func() error {
		for {
			err := client.Publish(ctx, r)
			notYet := errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ECONNREFUSED)
			if !notYet || len(exit) > 0 {
				return err
			}
			time.Sleep(10 * time.Millisecond) // not listening yet
		}
	})
	if err != nil {
		t.Fatalf("publish: %v\n%s", err, stderr.String())
	}
	if b, err := os.ReadFile(r.Target + "/marker"); err != nil || string(b) != "published" {
		t.Fatalf("the target shows %q, %v; want the publication", b, err)
	}
	if err := client.Unpublish(ctx, mounter.UnpublishRequest{VolumeID: r.VolumeID, Target: r.Target}); err != nil {
		t.Fatal(err)
	}
	cancel()
	if code := <-exit; code != 0 {
		t.Fatalf("vmsnap mounter exited %d: %s", code, stderr.String())
	}
	if _, err := os.Stat(r.Target); !os.IsNotExist(err) {
		t.Fatalf("the target is left after unpublish: %v", err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("the socket is left behind: %v", err)
	}
}

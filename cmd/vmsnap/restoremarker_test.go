package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

func TestRestoreMarker(t *testing.T) {
	dir := t.TempDir()
	d1, d2 := "sha256:"+strings.Repeat("1", 64), "sha256:"+strings.Repeat("2", 64)
	f := restoreFlags{image: "oci:/snap@" + d1, toDir: "/vm/state", markerDir: dir}
	var stdout, stderr bytes.Buffer
	out := &globalOutput{stdout: &stdout, stderr: &stderr}

	mark, done, err := restoredBefore(out, f)
	if err != nil || done || mark == nil {
		t.Fatalf("no marker yet: %v, done %v, mark %v", err, done, mark)
	}
	if want := filepath.Join(dir, "restored-sha256-"+strings.Repeat("1", 64)); mark.path != want {
		t.Fatalf("marker %s, want %s", mark.path, want)
	}
	if err := mark.write(&api.RestoreResult{Staged: &api.StagedState{Digest: d1, Dir: "/vm/state"}}); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Fatalf("marker dir holds %v, want the marker alone", entries)
	}

	// The same restore again: done, said so, the earlier result reported.
	_, done, err = restoredBefore(out, f)
	if err != nil || !done {
		t.Fatalf("second run: %v, done %v", err, done)
	}
	if !strings.Contains(stderr.String(), "already done in this pod (marker "+mark.path+")") ||
		!strings.Contains(stdout.String(), "already restored in this pod") {
		t.Errorf("the second run does not say it did nothing:\n%s%s", stderr.String(), stdout.String())
	}

	// Another request for the same state (a disk now), or another state: new restores.
	g := f
	g.diskImage, g.disk = "oci:/snap@"+d2, "/vm/disk/overlay.qcow2"
	if _, done, err := restoredBefore(out, g); err != nil || done {
		t.Errorf("a different request was taken as done: %v %v", err, done)
	}
	g = f
	g.image = "oci:/snap@" + d2
	if _, done, err := restoredBefore(out, g); err != nil || done {
		t.Errorf("a different digest was taken as done: %v %v", err, done)
	}

	// A marker it cannot read stops the restore: it may protect a disk.
	for name, content := range map[string][]byte{
		"corrupt":  []byte("{not json"),
		"oversize": bytes.Repeat([]byte(" "), maxMarkerBytes+1),
	} {
		if err := os.WriteFile(mark.path, content, 0o644); err != nil {
			t.Fatal(err)
		}
		if _, done, err := restoredBefore(out, f); errcode.Of(err) != errcode.InvalidInput || done {
			t.Errorf("%s marker: %v, done %v; want INVALID_INPUT", name, err, done)
		}
	}

	// A tag cannot key a marker.
	g = f
	g.image = "oci:/snap:v1"
	if _, _, err := restoredBefore(out, g); errcode.Of(err) != errcode.TagNotAllowed {
		t.Errorf("tag: %v, want TAG_NOT_ALLOWED", err)
	}
	cliError(t, errcode.Usage, "restore", "--image", "oci:/snap:v1", "--to-dir", t.TempDir(), "--marker-dir", dir, "--allow-tag")
	cliError(t, errcode.Usage, "restore", "--qmp", "/run/q.sock", "--image", "oci:/snap@"+d1, "--marker-dir", dir)
}

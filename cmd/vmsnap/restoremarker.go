package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// maxMarkerBytes bounds what is read of a marker: a result is a few hundred
// bytes.
const maxMarkerBytes = 64 << 10

// restoreMarker records, in a pod-scoped directory, that a restore before
// QEMU starts succeeded, so that a re-run of the same init container (its
// pod's sandbox recreated) does not replace an overlay the guest has
// written to since. It is named after the state image's digest (the disk
// image's without one) and holds the request and its result.
type restoreMarker struct {
	path string
	req  markerRequest
}

type markerRequest struct {
	Image     string `json:"image,omitempty"`
	DiskImage string `json:"diskImage,omitempty"`
	Disk      string `json:"disk,omitempty"`
	ToDir     string `json:"toDir,omitempty"`
}

type markerFile struct {
	Request markerRequest     `json:"request"`
	Result  api.RestoreResult `json:"result"`
}

// restoredBefore checks --marker-dir: when the same restore succeeded
// before in this pod, it reports that run's result, says so on stderr and
// returns done. Otherwise it returns the marker to write on success (nil
// without --marker-dir).
func restoredBefore(out *globalOutput, f restoreFlags) (mark *restoreMarker, done bool, err error) {
	if f.markerDir == "" {
		return nil, false, nil
	}
	if mark, err = newRestoreMarker(f); err != nil {
		return nil, false, err
	}
	res, err := mark.done()
	if err != nil || res == nil {
		return mark, false, err
	}
	fmt.Fprintf(out.stderr, "vmsnap restore: already done in this pod (marker %s): the overlay and the staged state are left as they are, not replaced\n", mark.path)
	report(out, res, func(w io.Writer) { printRestore(w, res) })
	return nil, true, nil
}

func newRestoreMarker(f restoreFlags) (*restoreMarker, error) {
	key := f.image
	if key == "" {
		key = f.diskImage
	}
	ref, err := ociimage.ParseReference(key)
	if err != nil {
		return nil, err
	}
	if ref.Digest == "" {
		return nil, errcode.New(errcode.TagNotAllowed, "%s: --marker-dir needs images by digest (REF@sha256:...), as checkpoint prints them", key)
	}
	return &restoreMarker{
		path: filepath.Join(f.markerDir, markerName("restored", ref.Digest)),
		req:  markerRequest{Image: f.image, DiskImage: f.diskImage, Disk: f.disk, ToDir: f.toDir},
	}, nil
}

// done returns the earlier run's result when the marker is there and names
// the same request, or nil: no marker, or one from another restore (this
// one is new, and replaces it when it succeeds). A marker it cannot read is
// an error rather than a reason to restore again: that could roll back a
// disk the guest has written to.
func (m *restoreMarker) done() (*api.RestoreResult, error) {
	fh, err := os.Open(m.path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	var mf markerFile
	if err == nil {
		defer fh.Close()
		var b []byte
		if b, err = io.ReadAll(io.LimitReader(fh, maxMarkerBytes+1)); err == nil && len(b) > maxMarkerBytes {
			err = errors.New("larger than any marker vmsnap writes")
		} else if err == nil {
			err = json.Unmarshal(b, &mf)
		}
	}
	if err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err,
			"reading the restore marker %s: this pod may have restored before, and restoring again could roll back its disk; remove the marker to restore anyway", m.path)
	}
	if mf.Request != m.req {
		return nil, nil
	}
	mf.Result.AlreadyRestored = m.path
	return &mf.Result, nil
}

// write puts the marker in place atomically (synced, renamed, directory
// synced), after everything else succeeded.
func (m *restoreMarker) write(res *api.RestoreResult) error {
	b, err := json.Marshal(markerFile{Request: m.req, Result: *res})
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "encoding the restore marker")
	}
	out, err := atomicfile.Create(m.path, 0o644)
	if err != nil {
		return errcode.Ensure(errcode.Internal, err, "writing the restore marker in --marker-dir (is it a writable volume?)")
	}
	defer out.Abort()
	if _, err := io.Copy(out, bytes.NewReader(append(b, '\n'))); err != nil {
		return err
	}
	if err := out.Commit(); err != nil {
		return errcode.Ensure(errcode.Internal, err, "the restore succeeded but its marker %s could not be written: a re-run would restore again", m.path)
	}
	return nil
}

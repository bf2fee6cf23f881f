package vmstate

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// ParentRecords is where a node keeps, per VM whose RAM is a shared file,
// the memory-file checkpoint it took of it last (or the image it prepared
// the VM's own RAM file from, PrepareOptions.CopyTo): the image's digest and
// repository, and the page map computed from the VM's memory. It is the
// only parent a checkpoint builds on without checking it against memory
// (findParent): nothing someone else wrote (a tag, a registry) decides it.
//
// A record is found by Key in Dir, or, Key empty, by the RAM file's
// identity (device and inode), and used only if the RAM file is still that
// very file (inode and birth time), the VM's memory backend is the
// record's, its Scope is this one's, and the checkpoint goes to the same
// repository.
type ParentRecords struct {
	// Dir is a directory of this user's alone (created mode 0700; every
	// directory above it must be this user's or root's and writable by no
	// one else): the agent's per VM, a user's own for the CLI.
	Dir string
	// Key names the record in Dir; empty, the RAM file's identity does.
	Key string
	// Scope is written into the record and must match to use it: the
	// agent's namespace, pod UID and container.
	Scope string
}

const (
	recordVersion = 1
	// maxRecordHeader bounds a record's JSON.
	maxRecordHeader = 64 << 10
	// maxRecords is how many records a directory keeps: past it, the
	// oldest go.
	maxRecords = 256
)

// maxRecordMap bounds a recorded page map of a RAM file of size bytes:
// its entries, and room for zstd's framing of incompressible data.
func maxRecordMap(size int64) int64 {
	raw := int64(ramfile.Pages(size)) * 24
	return raw + raw/64 + 1<<16
}

// parentRecord is a record's JSON (NAME.json); its page map is NAME.map.
type parentRecord struct {
	Version    int                `json:"version"`
	Scope      string             `json:"scope"`
	Image      ocispec.Descriptor `json:"image"`
	Repository string             `json:"repository"`
	Backend    string             `json:"backend"`
	Bytes      int64              `json:"bytes"`
	File       fileID             `json:"file"`
	// Path is where the RAM file was (records found by its identity): one
	// whose file is gone from there is removed (prune).
	Path     string        `json:"path,omitempty"`
	Map      digest.Digest `json:"map"`
	MapBytes int64         `json:"mapBytes"`
	Created  time.Time     `json:"created"`
}

// fileID is which file a RAM file is: an inode of a device, born at a time
// (0 where the filesystem does not say), so that a file created later under
// a reused inode number is another.
type fileID struct {
	Dev   uint64 `json:"dev"`
	Ino   uint64 `json:"ino"`
	Birth int64  `json:"birth,omitempty"` // ns since the epoch
}

func identify(f *os.File) (fileID, error) {
	var st unix.Statx_t
	if err := unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_INO|unix.STATX_BTIME, &st); err != nil {
		return fileID{}, errcode.Wrap(errcode.Internal, err, "reading the RAM file's identity")
	}
	id := fileID{Dev: unix.Mkdev(st.Dev_major, st.Dev_minor), Ino: st.Ino}
	if st.Mask&unix.STATX_BTIME != 0 {
		id.Birth = st.Btime.Sec*1e9 + int64(st.Btime.Nsec)
	}
	return id, nil
}

// recordedParent is a record that holds for this checkpoint.
type recordedParent struct {
	image   ocispec.Descriptor
	pageMap *ramfile.PageMap
}

// repositoryKey says which repository a reference is in: a layout's
// absolute directory, or a registry's host (case ignored) and repository.
func repositoryKey(ref ociimage.Reference) string {
	if ref.IsLayout() {
		if abs, err := filepath.Abs(ref.Layout); err == nil {
			return "oci:" + abs
		}
		return "oci:" + filepath.Clean(ref.Layout)
	}
	return strings.ToLower(ref.Registry) + "/" + ref.Repository
}

func (r *ParentRecords) name(id fileID) string {
	if r.Key != "" {
		return r.Key
	}
	return fmt.Sprintf("ram-%x-%x", id.Dev, id.Ino)
}

// load returns the record for the VM whose RAM file is f, if one holds for
// a checkpoint of backend be into repo; otherwise why none does (a fresh
// base then says so).
func (r *ParentRecords) load(f *os.File, be *RAMBackend, repo ociimage.Repository) (*recordedParent, string) {
	if r == nil || r.Dir == "" {
		return nil, "this checkpoint keeps no record of the VM's checkpoints (no parent records directory): a base"
	}
	// Only a directory no one else may write holds records this trusts.
	if err := ramfile.OwnDir(r.Dir, "parent records directory"); err != nil {
		return nil, fmt.Sprintf("the node's record of this VM could not be looked up (%v): a base", err)
	}
	id, err := identify(f)
	if err != nil {
		return nil, fmt.Sprintf("the node's record of this VM could not be looked up (%v): a base", err)
	}
	var rec parentRecord
	header, err := r.read(r.name(id)+".json", maxRecordHeader)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, "no checkpoint of this VM is recorded on this node (the first here, or taken elsewhere): a base"
	}
	if err == nil {
		err = json.Unmarshal(header, &rec)
	}
	if err != nil {
		return nil, fmt.Sprintf("the node's record of this VM is unreadable (%v): a base", err)
	}
	if why := rec.mismatch(r.Scope, id, be, repo); why != "" {
		return nil, why + ": a base"
	}
	data, err := r.read(r.name(id)+".map", rec.MapBytes)
	if err == nil && (int64(len(data)) != rec.MapBytes || digest.FromBytes(data) != rec.Map) {
		err = errcode.New(errcode.DigestMismatch, "its page map is not the one recorded")
	}
	var m *ramfile.PageMap
	if err == nil {
		m, err = ramfile.DecodePageMap(data, be.Bytes)
	}
	if err != nil {
		return nil, fmt.Sprintf("the node's record of this VM is unreadable (%v): a base", err)
	}
	return &recordedParent{image: rec.Image, pageMap: m}, ""
}

// mismatch says why a record does not hold for this checkpoint ("" if it
// does).
func (rec *parentRecord) mismatch(scope string, id fileID, be *RAMBackend, repo ociimage.Repository) string {
	switch {
	case rec.Version != recordVersion:
		return fmt.Sprintf("the node's record of this VM is of version %d, not %d", rec.Version, recordVersion)
	case rec.Scope != scope:
		return "the node's record under this VM's name is another VM's"
	case rec.File != id:
		return "the node's record of this VM is of an earlier RAM file (the VM's file was replaced)"
	case rec.Backend != be.ID || rec.Bytes != be.Bytes:
		return fmt.Sprintf("the node's record of this VM is of memory backend %s of %d MiB, the VM's is %s of %d MiB", rec.Backend, rec.Bytes>>20, be.ID, be.Bytes>>20)
	case rec.Image.MediaType != ocispec.MediaTypeImageManifest || rec.Image.Digest.Validate() != nil || rec.Image.Size <= 0:
		return "the node's record of this VM names no manifest"
	case rec.MapBytes <= 0 || rec.MapBytes > maxRecordMap(be.Bytes):
		return fmt.Sprintf("the node's record of this VM has a page map of %d bytes, not one of a %d MiB RAM file", rec.MapBytes, be.Bytes>>20)
	case rec.Repository != repositoryKey(repo.Reference()):
		return fmt.Sprintf("the VM's last checkpoint is in %s, this one goes to %s, and a delta lists its parent's layers, which must be in its own repository", rec.Repository, repositoryKey(repo.Reference()))
	}
	return ""
}

// read reads a record file of at most max bytes: a regular file, opened
// without following a link or blocking.
func (r *ParentRecords) read(name string, max int64) ([]byte, error) {
	f, err := os.OpenFile(filepath.Join(r.Dir, name), os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() || fi.Size() > max {
		return nil, errcode.New(errcode.InvalidInput, "%s is not a regular file of at most %d bytes", name, max)
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err == nil && int64(len(b)) > max {
		err = errcode.New(errcode.InvalidInput, "%s is over %d bytes", name, max)
	}
	return b, err
}

// save records image, just committed into repo, as the checkpoint of the
// VM whose RAM file is f and whose memory m maps.
func (r *ParentRecords) save(f *os.File, be *RAMBackend, repo ociimage.Repository, image ocispec.Descriptor, m *ramfile.PageMap) error {
	if r == nil || r.Dir == "" {
		return nil
	}
	if err := ramfile.OwnDir(r.Dir, "parent records directory"); err != nil {
		return err
	}
	id, err := identify(f)
	if err != nil {
		return err
	}
	data, err := ramfile.EncodePageMap(m)
	if err != nil {
		return err
	}
	rec := parentRecord{Version: recordVersion, Scope: r.Scope, Repository: repositoryKey(repo.Reference()), Backend: be.ID, Bytes: be.Bytes, File: id, Path: be.MemPath,
		Image: ocispec.Descriptor{MediaType: image.MediaType, Digest: image.Digest, Size: image.Size},
		Map:   digest.FromBytes(data), MapBytes: int64(len(data)), Created: time.Now().UTC()}
	header, err := json.Marshal(rec)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "encoding the parent record")
	}
	name := r.name(id)
	// The map first: a header names only a map whose digest it checks.
	for _, w := range []struct {
		file string
		data []byte
	}{{name + ".map", data}, {name + ".json", header}} {
		if err := atomicfile.WriteFile(filepath.Join(r.Dir, w.file), w.data, 0o600); err != nil {
			return errcode.Wrap(errcode.Internal, err, "writing the parent record %s", w.file)
		}
	}
	r.prune()
	return nil
}

// prune removes, from a directory of records found by identity (a user's
// VMs), those whose RAM file is no longer where it was (the VM is gone),
// then the oldest past maxRecords. A path is only looked at (lstat),
// never opened.
func (r *ParentRecords) prune() {
	if r.Key != "" {
		return // one record, the VM's own
	}
	headers, _ := filepath.Glob(filepath.Join(r.Dir, "*.json"))
	remove := func(h string) {
		os.Remove(h)
		os.Remove(strings.TrimSuffix(h, ".json") + ".map")
	}
	live := headers[:0]
	for _, h := range headers {
		if r.gone(filepath.Base(h)) {
			remove(h)
		} else {
			live = append(live, h)
		}
	}
	headers = live
	if len(headers) <= maxRecords {
		return
	}
	mtime := func(p string) time.Time {
		fi, err := os.Lstat(p)
		if err != nil {
			return time.Time{}
		}
		return fi.ModTime()
	}
	slices.SortFunc(headers, func(a, b string) int { return mtime(a).Compare(mtime(b)) })
	for _, h := range headers[:len(headers)-maxRecords] {
		remove(h)
	}
}

// gone says whether the record named name is of a RAM file no longer at
// its path (or is not a record at all).
func (r *ParentRecords) gone(name string) bool {
	b, err := r.read(name, maxRecordHeader)
	if err != nil {
		return false // left for load to report
	}
	var rec parentRecord
	if json.Unmarshal(b, &rec) != nil {
		return true
	}
	if rec.Path == "" {
		return false
	}
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, rec.Path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_INO, &st); err != nil {
		return errors.Is(err, fs.ErrNotExist)
	}
	return unix.Mkdev(st.Dev_major, st.Dev_minor) != rec.File.Dev || st.Ino != rec.File.Ino
}

package vmstate

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/forge"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// parentRun is one victim VM checkpointed with a record directory.
type parentRun struct {
	t       *testing.T
	dir     string // the layout
	ram     string // the VM's RAM file
	records *ParentRecords
}

func newParentRun(t *testing.T) *parentRun {
	_, ram := fakeFileVM(t)
	return &parentRun{t: t, dir: t.TempDir(), ram: ram, records: &ParentRecords{Dir: filepath.Join(t.TempDir(), "records")}}
}

// checkpoint checkpoints the VM (a fake QEMU on its RAM file) to tag.
func (r *parentRun) checkpoint(tag string, opts CheckpointOptions) *CheckpointResult {
	r.t.Helper()
	q, _ := fakeFileVMAt(r.t, r.ram)
	opts.StagingDir = r.t.TempDir()
	if opts.Records == nil {
		opts.Records = r.records
	}
	res, err := Checkpoint(context.Background(), q.Dial(r.t), openLayout(r.t, "oci:"+r.dir+":"+tag), opts)
	if err != nil {
		r.t.Fatal(err)
	}
	return res
}

// restoresExactly prepares res's image and checks that the RAM file it
// gives is the VM's memory, byte for byte.
func (r *parentRun) restoresExactly(res *CheckpointResult) {
	r.t.Helper()
	want, err := os.ReadFile(r.ram)
	if err != nil {
		r.t.Fatal(err)
	}
	got := materialized(r.t, r.t.TempDir(), "oci:"+r.dir+"@"+res.Manifest.Digest.String())
	if !bytes.Equal(got, want) {
		r.t.Fatalf("the prepared RAM file is not the VM's memory: %s", firstDifference(got, want))
	}
}

func firstDifference(got, want []byte) string {
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			return fmt.Sprintf("first difference at byte %d (page %d)", i, i/ramfile.PageSize)
		}
	}
	return fmt.Sprintf("%d bytes, want %d", len(got), len(want))
}

// plantForgedParent has the attacker put, under tag, a parent whose page
// map carries the victim's xxhash64 and the SHA-256 of the attacker's own
// pages over the victim's first 4 MiB (forge.Parent).
func (r *parentRun) plantForgedParent(victim ocispec.Descriptor, tag string) (ocispec.Descriptor, int) {
	r.t.Helper()
	repo := openLayout(r.t, "oci:"+r.dir)
	forged, pages, err := forge.Parent(context.Background(), repo, victim, 4<<20, 666, r.t.TempDir())
	if err != nil {
		r.t.Fatal(err)
	}
	if err := ociimage.TagManifest(context.Background(), repo, forged, tag); err != nil {
		r.t.Fatal(err)
	}
	return forged, len(pages)
}

// Issue 21, HIGH 2, as reported: whoever may write the VM's tag once plants
// a parent whose map carries the victim's fast hashes and the strong hashes
// of the attacker's pages. The victim's next checkpoint under its tag must
// still restore exactly the victim's memory: it builds on the checkpoint
// the node recorded for the VM, never on what the tag names.
func TestMemoryFileTagWriterCannotPlantAParent(t *testing.T) {
	r := newParentRun(t)
	v1 := r.checkpoint("vm", CheckpointOptions{})
	forged, _ := r.plantForgedParent(v1.Manifest, "vm")

	v2 := r.checkpoint("vm", CheckpointOptions{})
	if p := v2.Config.RAM.Parent(); p == forged.Digest {
		t.Errorf("the victim's checkpoint built on the forged parent the tag named")
	} else if p != v1.Manifest.Digest || v2.RAMParentTrust != ParentRecorded {
		t.Errorf("parent %s (%s), want the recorded %s", p, v2.RAMParentTrust, v1.Manifest.Digest)
	}
	r.restoresExactly(v2)
}

// The same forged parent named explicitly (--parent), not the node's
// record: each page it vouches for is checked against the VM's memory,
// the attacker's are refuted and stored, and the image restores the
// victim's memory.
func TestMemoryFileExplicitParentIsVerifiedAgainstMemory(t *testing.T) {
	r := newParentRun(t)
	v1 := r.checkpoint("vm", CheckpointOptions{})
	forged, lies := r.plantForgedParent(v1.Manifest, "evil")
	for _, mode := range []Mode{ModeSnapshot, ModePause} { // a pre-copy, a scan
		// An empty record directory: the parent is not the node's.
		v2 := r.checkpoint("vm", CheckpointOptions{Mode: mode, Parent: &forged, Records: &ParentRecords{Dir: t.TempDir()}})
		if v2.Config.RAM.Parent() != forged.Digest || v2.RAMParentTrust != ParentVerified {
			t.Fatalf("%s: parent %s (%s), want the named one, verified", mode, v2.Config.RAM.Parent(), v2.RAMParentTrust)
		}
		if v2.RAMRefutedPages != lies || v2.Config.RAM.Chain[2].ChangedPages != lies {
			t.Errorf("%s: %d pages refuted, %d stored; the parent vouched falsely for %d", mode, v2.RAMRefutedPages, v2.Config.RAM.Chain[2].ChangedPages, lies)
		}
		r.restoresExactly(v2)
	}
	// The recorded parent named explicitly is trusted as recorded.
	v3 := r.checkpoint("vm", CheckpointOptions{Parent: &v1.Manifest})
	if v3.RAMParentTrust != ParentRecorded || v3.RAMRefutedPages != 0 {
		t.Errorf("the recorded parent named explicitly: %s, %d refuted", v3.RAMParentTrust, v3.RAMRefutedPages)
	}
}

// Without a record, a checkpoint is a base, whatever its tag names: the
// first checkpoint of a VM on this node, or one whose records are off.
func TestMemoryFileWithoutARecordTakesABase(t *testing.T) {
	r := newParentRun(t)
	v1 := r.checkpoint("vm", CheckpointOptions{})
	r.plantForgedParent(v1.Manifest, "vm")
	for name, records := range map[string]*ParentRecords{"no record": {Dir: t.TempDir()}, "records off": {}} {
		v := r.checkpoint("vm", CheckpointOptions{Records: records})
		if len(v.Config.RAM.Chain) != 1 || v.RAMParentTrust != "" || !strings.Contains(v.RAMParentNote, "a base") {
			t.Errorf("%s: chain %d, trust %q, note %q: want a base saying why", name, len(v.Config.RAM.Chain), v.RAMParentTrust, v.RAMParentNote)
		}
		r.restoresExactly(v)
	}
}

// A controller that gives every checkpoint a tag of its own (the Job
// template's ${TAG}) gets deltas: the parent is the node's record, not a
// tag. Four tags, a scattered 5% rewrite between each: each uploads a
// small part of the image.
func TestMemoryFileRecordedParentServesUniqueTags(t *testing.T) {
	r := newParentRun(t)
	rng := rand.New(rand.NewPCG(4, 4))
	var prev *CheckpointResult
	for i := range 4 {
		if i > 0 {
			rewriteScattered(t, r.ram, rng, 1024*5/100)
		}
		v := r.checkpoint(fmt.Sprintf("ckpt-%d", i), CheckpointOptions{})
		if prev != nil {
			if v.Config.RAM.Parent() != prev.Manifest.Digest {
				t.Fatalf("checkpoint %d: parent %q (%s), want the one before", i, v.Config.RAM.Parent(), v.RAMParentNote)
			}
			if share := float64(v.Stream.UploadedBytes) / float64(v.Stream.StoredBytes); share > 0.15 {
				t.Errorf("checkpoint %d uploaded %d of %d bytes (%.0f%%) for a 5%% rewrite", i, v.Stream.UploadedBytes, v.Stream.StoredBytes, 100*share)
			}
		}
		r.restoresExactly(v)
		prev = v
	}
}

// rewriteScattered writes n random pages at random places of the first
// 4 MiB (the fake VM's data).
func rewriteScattered(t *testing.T, path string, rng *rand.Rand, n int) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := make([]byte, ramfile.PageSize)
	for range n {
		for k := range p {
			p[k] = byte(rng.Uint32())
		}
		if _, err := f.WriteAt(p, int64(rng.IntN(1024))*ramfile.PageSize); err != nil {
			t.Fatal(err)
		}
	}
}

// A record holds only for the VM, file and repository it was made for. (As
// the agent keeps them: one per VM, by a key; without one, a record is
// found by the RAM file's inode, and another file finds none.)
func TestMemoryFileRecordHoldsOnlyForItsVMFileAndRepository(t *testing.T) {
	for name, tc := range map[string]struct {
		change func(r *parentRun) CheckpointOptions
		note   string
	}{
		"another repository": {func(r *parentRun) CheckpointOptions {
			r.dir = t.TempDir()
			return CheckpointOptions{}
		}, "its own repository"},
		"the RAM file replaced": {func(r *parentRun) CheckpointOptions {
			b, _ := os.ReadFile(r.ram)
			os.WriteFile(r.ram+".new", b, 0o600)
			os.Rename(r.ram+".new", r.ram)
			return CheckpointOptions{}
		}, "earlier RAM file"},
		"another scope": {func(r *parentRun) CheckpointOptions {
			return CheckpointOptions{Records: &ParentRecords{Dir: r.records.Dir, Key: r.records.Key, Scope: "ns/other-pod/qemu"}}
		}, "another VM's"},
		"a directory others may write": {func(r *parentRun) CheckpointOptions {
			os.Chmod(r.records.Dir, 0o777)
			return CheckpointOptions{}
		}, "mode 0700"},
		"a tampered page map": {func(r *parentRun) CheckpointOptions {
			maps, _ := filepath.Glob(filepath.Join(r.records.Dir, "*.map"))
			for _, m := range maps {
				b, _ := os.ReadFile(m)
				b[len(b)/2] ^= 1
				os.WriteFile(m, b, 0o600)
			}
			return CheckpointOptions{}
		}, "unreadable"},
	} {
		t.Run(name, func(t *testing.T) {
			r := newParentRun(t)
			r.records.Key = "vm"
			r.checkpoint("vm", CheckpointOptions{})
			v := r.checkpoint("vm", tc.change(r))
			if len(v.Config.RAM.Chain) != 1 || !strings.Contains(v.RAMParentNote, tc.note) {
				t.Fatalf("chain %d, note %q: want a base saying %q", len(v.Config.RAM.Chain), v.RAMParentNote, tc.note)
			}
			r.restoresExactly(v)
		})
	}
}

// A directory of records found by identity (a user's, the CLI's) drops
// the record of a RAM file that is gone from its path when it records
// another, and keeps the others'.
func TestMemoryFileRecordsOfGoneFilesArePruned(t *testing.T) {
	records := &ParentRecords{Dir: filepath.Join(t.TempDir(), "records")}
	a, b := newParentRun(t), newParentRun(t)
	a.records, b.records = records, records
	a.checkpoint("a", CheckpointOptions{})
	b.checkpoint("b", CheckpointOptions{})
	if n := recordCount(t, records.Dir); n != 2 {
		t.Fatalf("%d records, want 2", n)
	}
	os.Remove(a.ram)
	b.checkpoint("b", CheckpointOptions{})
	if n := recordCount(t, records.Dir); n != 1 {
		t.Fatalf("%d records after a's RAM file went, want b's alone", n)
	}
	if v := b.checkpoint("b", CheckpointOptions{}); v.RAMParentTrust != ParentRecorded {
		t.Fatalf("b's record went too: %s", v.RAMParentNote)
	}
}

func recordCount(t *testing.T, dir string) int {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	return len(m)
}

// prepare --copy-to gives a VM its own copy of an image's RAM file,
// checked page by page against the image's map, and records the image as
// that file's last checkpoint: the restored VM's next checkpoint is a
// delta on it. A copy that is not the image (the cache file changed) is
// refused and removed.
func TestMemoryFilePreparedCopyIsRecordedAsTheNextParent(t *testing.T) {
	r := newParentRun(t)
	v1 := r.checkpoint("vm", CheckpointOptions{})
	target := &ParentRecords{Dir: filepath.Join(t.TempDir(), "target-records")} // another node's
	cache := ramfile.Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	copies := t.TempDir()
	prepare := func() (*PrepareResult, error) {
		return Prepare(context.Background(), openLayout(t, "oci:"+r.dir+"@"+v1.Manifest.Digest.String()), PrepareOptions{Cache: cache, CopyTo: copies, Records: target})
	}
	p, err := prepare()
	if err != nil || p.RecordNote != "" {
		t.Fatalf("prepare --copy-to: %v, note %q", err, p.RecordNote)
	}
	restored := &parentRun{t: t, dir: r.dir, ram: p.MemoryFile, records: target}
	rewriteScattered(t, restored.ram, rand.New(rand.NewPCG(8, 8)), 20)
	v2 := restored.checkpoint("vm-restored", CheckpointOptions{})
	if v2.Config.RAM.Parent() != v1.Manifest.Digest || v2.RAMParentTrust != ParentRecorded {
		t.Fatalf("the restored VM's checkpoint: parent %q (%s; %s), want the prepared image, recorded", v2.Config.RAM.Parent(), v2.RAMParentTrust, v2.RAMParentNote)
	}
	restored.restoresExactly(v2)

	f, err := os.OpenFile(cache.Path(v1.Manifest.Digest), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte{0xff}, 4096+7)
	f.Close()
	if _, err := prepare(); errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("a copy of a changed cache file: %v, want DIGEST_MISMATCH", err)
	}
	if left, _ := filepath.Glob(filepath.Join(copies, "*")); len(left) != 1 {
		t.Fatalf("copies left: %v, want the first one only", left)
	}
}

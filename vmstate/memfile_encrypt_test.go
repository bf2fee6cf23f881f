package vmstate

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// A memory-file checkpoint encrypted: its region and page map layers are
// stored encrypted; with the key to read its parent's page map, the next
// checkpoint is a delta that names the parent's encrypted regions and
// uploads only what changed; without it, a fresh base, saying why.
func TestMemoryFileEncrypted(t *testing.T) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	id, _ := imgcrypt.KeyID(&k.PublicKey)
	enc := imgcrypt.WithEncryption(imgcrypt.EncryptOptions{Recipients: []imgcrypt.Recipient{{Key: &k.PublicKey, ID: id}}})
	key := imgcrypt.WithDecryptionKeys(imgcrypt.DecryptionKey{Key: k, ID: id})
	dir := t.TempDir()
	open := func(ref string, opts ...ociimage.Option) ociimage.Repository {
		r, _ := ociimage.ParseReference(ref)
		repo, err := ociimage.Open(context.Background(), r, opts...)
		if err != nil {
			t.Fatal(err)
		}
		return repo
	}

	q, path := fakeFileVM(t)
	records := &ParentRecords{Dir: filepath.Join(t.TempDir(), "records")}
	base, err := Checkpoint(context.Background(), q.Dial(t), open("oci:"+dir+":vm", enc, key), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir(), Records: records})
	if err != nil {
		t.Fatal(err)
	}
	stored, err := open("oci:"+dir).Manifest(context.Background(), base.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range stored.Layers {
		if !imgcrypt.IsEncrypted(l) {
			t.Fatalf("layer %d (%s) is stored in the clear", i, l.MediaType)
		}
	}

	f, _ := os.OpenFile(path, os.O_RDWR, 0)
	f.WriteAt(bytes.Repeat([]byte{0x5a}, ramfile.PageSize), 9*ramfile.PageSize)
	f.Close()
	delta, err := Checkpoint(context.Background(), q.Dial(t), open("oci:"+dir+":vm", enc, key), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir(), Records: records})
	if err != nil {
		t.Fatal(err)
	}
	if r := delta.Config.RAM; len(r.Chain) != 2 || r.Parent() != base.Manifest.Digest || delta.Stream.UploadedBytes > 256<<10 {
		t.Fatalf("second encrypted checkpoint: chain %d, uploaded %d: not a small delta", len(r.Chain), delta.Stream.UploadedBytes)
	}
	dm, err := open("oci:"+dir).Manifest(context.Background(), delta.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range dm.Layers {
		if !imgcrypt.IsEncrypted(l) {
			t.Fatalf("delta layer %d (%s) is stored in the clear", i, l.MediaType)
		}
	}
	want, _ := os.ReadFile(path)
	res, err := Prepare(context.Background(), open("oci:"+dir+"@"+delta.Manifest.Digest.String(), key), PrepareOptions{Cache: ramfile.Cache{Dir: filepath.Join(t.TempDir(), "cache")}})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(res.MemoryFile); !bytes.Equal(got, want) {
		t.Fatal("the encrypted base + delta does not give the RAM file back")
	}

	// Without the key, the parent cannot be read: a base.
	third, err := Checkpoint(context.Background(), q.Dial(t), open("oci:"+dir+":vm", enc), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir(), Records: records})
	if err != nil {
		t.Fatal(err)
	}
	if len(third.Config.RAM.Chain) != 1 || !strings.Contains(third.RAMParentNote, "encrypted") {
		t.Fatalf("without a key: chain %d, note %q", len(third.Config.RAM.Chain), third.RAMParentNote)
	}
	t.Logf("without the key: %s", third.RAMParentNote)
}

// Turning encryption on, off, or for other recipients, for a VM whose
// chain is otherwise: the next checkpoint is a fresh base that says why,
// encrypted as asked, and no image references layers encrypted otherwise
// than its own (issue 21, LOW 8: it failed with INTERNAL, every time).
func TestMemoryFileEncryptionChangeTakesAFreshBase(t *testing.T) {
	keyFor := func() (imgcrypt.Recipient, imgcrypt.DecryptionKey) {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		id, _ := imgcrypt.KeyID(&k.PublicKey)
		return imgcrypt.Recipient{Key: &k.PublicKey, ID: id}, imgcrypt.DecryptionKey{Key: k, ID: id}
	}
	a, aKey := keyFor()
	b, _ := keyFor()
	keys := imgcrypt.WithDecryptionKeys(aKey)
	forA := imgcrypt.WithEncryption(imgcrypt.EncryptOptions{Recipients: []imgcrypt.Recipient{a}})
	forAB := imgcrypt.WithEncryption(imgcrypt.EncryptOptions{Recipients: []imgcrypt.Recipient{a, b}})
	dir := t.TempDir()
	records := &ParentRecords{Dir: filepath.Join(t.TempDir(), "records")}
	_, path := fakeFileVM(t)
	var prev *CheckpointResult
	for i, step := range []struct {
		name      string
		opts      []ociimage.Option
		encrypted bool
		delta     bool
		note      string
	}{
		{"in the clear", nil, false, false, ""},
		{"encryption turned on", []ociimage.Option{forA, keys}, true, false, "stored in the clear, this checkpoint's are encrypted for"},
		{"the same recipient", []ociimage.Option{forA, keys}, true, true, ""},
		{"a recipient added", []ociimage.Option{forAB, keys}, true, false, "its layers are encrypted for " + a.ID + ", this checkpoint's are encrypted for"},
		{"encryption turned off", []ociimage.Option{keys}, false, false, "this checkpoint's are stored in the clear"},
	} {
		ref, _ := ociimage.ParseReference("oci:" + dir + ":vm")
		repo, err := ociimage.Open(context.Background(), ref, step.opts...)
		if err != nil {
			t.Fatal(err)
		}
		q, _ := fakeFileVMAt(t, path)
		res, err := Checkpoint(context.Background(), q.Dial(t), repo, CheckpointOptions{StagingDir: t.TempDir(), Records: records})
		if err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		if delta := len(res.Config.RAM.Chain) > 1; delta != step.delta || !strings.Contains(res.RAMParentNote, step.note) {
			t.Fatalf("%s: delta %v (note %q), want delta %v saying %q", step.name, delta, res.RAMParentNote, step.delta, step.note)
		}
		if step.delta && res.Config.RAM.Parent() != prev.Manifest.Digest {
			t.Fatalf("%s: not a delta on the checkpoint before", step.name)
		}
		raw, _ := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir})
		stored, err := raw.Manifest(context.Background(), res.Manifest)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range stored.Layers {
			if imgcrypt.IsEncrypted(l) != step.encrypted {
				t.Fatalf("%s: layer %s (%s) encrypted %v, want %v", step.name, l.Digest, l.MediaType, imgcrypt.IsEncrypted(l), step.encrypted)
			}
		}
		pinned, _ := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir, Digest: res.Manifest.Digest}, keys)
		p, err := Prepare(context.Background(), pinned, PrepareOptions{Cache: ramfile.Cache{Dir: filepath.Join(t.TempDir(), "cache")}})
		if err != nil {
			t.Fatalf("%s: prepare: %v", step.name, err)
		}
		got, _ := os.ReadFile(p.MemoryFile)
		if want, _ := os.ReadFile(path); !bytes.Equal(got, want) {
			t.Fatalf("%s (checkpoint %d): the prepared RAM file is not the VM's memory", step.name, i)
		}
		prev = res
	}
}

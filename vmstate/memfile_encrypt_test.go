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
	id, _ := ociimage.KeyID(&k.PublicKey)
	enc := ociimage.WithEncryption(ociimage.EncryptOptions{Recipients: []ociimage.Recipient{{Key: &k.PublicKey, ID: id}}})
	key := ociimage.WithDecryptionKeys(ociimage.DecryptionKey{Key: k, ID: id})
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
	base, err := Checkpoint(context.Background(), q.Dial(t), open("oci:"+dir+":vm", enc, key), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	stored, err := open("oci:"+dir).Manifest(context.Background(), base.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range stored.Layers {
		if !ociimage.IsEncrypted(l) {
			t.Fatalf("layer %d (%s) is stored in the clear", i, l.MediaType)
		}
	}

	f, _ := os.OpenFile(path, os.O_RDWR, 0)
	f.WriteAt(bytes.Repeat([]byte{0x5a}, ramfile.PageSize), 9*ramfile.PageSize)
	f.Close()
	delta, err := Checkpoint(context.Background(), q.Dial(t), open("oci:"+dir+":vm", enc, key), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir()})
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
		if !ociimage.IsEncrypted(l) {
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
	third, err := Checkpoint(context.Background(), q.Dial(t), open("oci:"+dir+":vm", enc), CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if len(third.Config.RAM.Chain) != 1 || !strings.Contains(third.RAMParentNote, "encrypted") {
		t.Fatalf("without a key: chain %d, note %q", len(third.Config.RAM.Chain), third.RAMParentNote)
	}
	t.Logf("without the key: %s", third.RAMParentNote)
}

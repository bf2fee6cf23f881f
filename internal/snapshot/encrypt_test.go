package snapshot

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"os"
	"path/filepath"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

func testRecipient(t *testing.T) (imgcrypt.Recipient, imgcrypt.DecryptionKey) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	id, err := imgcrypt.KeyID(&k.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	return imgcrypt.Recipient{Key: &k.PublicKey, ID: id}, imgcrypt.DecryptionKey{Key: k, ID: id}
}

// An encrypted checkpoint stages, with its key, into a plaintext layout
// that streams the exact state; without it nothing is staged.
func TestStageEncrypted(t *testing.T) {
	r, k := testRecipient(t)
	state := randomState(t, 2<<20)
	vm := qmptest.NewFakeQEMU(t, "running", state)
	res, err := Checkpoint(context.Background(), CheckpointSpec{
		QMPPath: vm.Path(), Image: "oci:" + t.TempDir() + ":vm", Stream: chunk.StreamOptions{ChunkSize: 256 << 10},
		Store: []ociimage.Option{imgcrypt.WithEncryption(imgcrypt.EncryptOptions{Recipients: []imgcrypt.Recipient{r}})},
	})
	if err != nil {
		t.Fatal(err)
	}
	// Inspect needs no key, and says for whom the image is encrypted.
	ins, err := Inspect(context.Background(), InspectSpec{Image: res.VMState.Image})
	if err != nil {
		t.Fatal(err)
	}
	if len(ins.EncryptedFor) != 1 || ins.EncryptedFor[0] != r.ID || ins.VMState == nil {
		t.Fatalf("inspect: encrypted for %v, want [%s]", ins.EncryptedFor, r.ID)
	}
	dir := filepath.Join(t.TempDir(), "staged")
	_, err = Stage(context.Background(), StageSpec{Image: res.VMState.Image, Dir: dir})
	if !errcode.Is(err, errcode.AuthFailed) {
		t.Fatalf("staging without the key: %v, want AUTH_FAILED", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "blobs")); err == nil {
		t.Fatal("an image that could not be decrypted was partly staged")
	}
	st, err := Stage(context.Background(), StageSpec{Image: res.VMState.Image, Dir: dir, Store: []ociimage.Option{imgcrypt.WithDecryptionKeys(k)}})
	if err != nil {
		t.Fatal(err)
	}
	if st.Digest != res.VMState.Digest {
		t.Fatalf("staged %s, checkpointed %s", st.Digest, res.VMState.Digest)
	}
	var out bytes.Buffer
	if err := StreamStaged(context.Background(), dir, &out, chunk.StreamOptions{}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), state) {
		t.Fatalf("streamed %d bytes, not the %d captured", out.Len(), len(state))
	}
}

// The trade-off of EncryptOptions.DedupSecret through the real chunk
// pipeline: a second checkpoint of an unchanged VM into the same store
// uploads nothing with it and everything without it.
func TestEncryptedRepeatCheckpointUploads(t *testing.T) {
	r, k := testRecipient(t)
	state := randomState(t, 4<<20)
	for _, tc := range []struct {
		name   string
		secret []byte
		want   func(uploaded, first int64) bool
	}{
		{"random layer keys: everything again", nil, func(u, first int64) bool { return u == first }},
		{"dedup secret: nothing again", bytes.Repeat([]byte{9}, 32), func(u, _ int64) bool { return u == 0 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := "oci:" + t.TempDir() + ":vm"
			opts := []ociimage.Option{imgcrypt.WithEncryption(imgcrypt.EncryptOptions{Recipients: []imgcrypt.Recipient{r}, DedupSecret: tc.secret})}
			var last string
			var first int64
			for i := range 2 {
				vm := qmptest.NewFakeQEMU(t, "running", state)
				res, err := Checkpoint(context.Background(), CheckpointSpec{
					QMPPath: vm.Path(), Image: store, Stream: chunk.StreamOptions{ChunkSize: 256 << 10}, Store: opts,
				})
				if err != nil {
					t.Fatal(err)
				}
				s := res.VMState
				t.Logf("checkpoint %d: %d chunks, %d stored, %d uploaded", i+1, s.Chunks, s.StoredBytes, s.UploadedBytes)
				if i == 0 {
					if first = s.UploadedBytes; first < s.StoredBytes/2 {
						t.Fatalf("first checkpoint uploaded %d of %d", s.UploadedBytes, s.StoredBytes)
					}
				}
				if i == 1 && !tc.want(s.UploadedBytes, first) {
					t.Fatalf("second checkpoint of an unchanged VM uploaded %d bytes, the first %d", s.UploadedBytes, first)
				}
				last = s.Image
			}
			// And the second one restores.
			dir := filepath.Join(t.TempDir(), "staged")
			if _, err := Stage(context.Background(), StageSpec{Image: last, Dir: dir, Store: []ociimage.Option{imgcrypt.WithDecryptionKeys(k)}}); err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			if err := StreamStaged(context.Background(), dir, &out, chunk.StreamOptions{}); err != nil || !bytes.Equal(out.Bytes(), state) {
				t.Fatalf("restoring the second checkpoint: %v (%d bytes)", err, out.Len())
			}
		})
	}
}

package e2e

import (
	"bytes"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
)

// skopeo (ocicrypt) decrypts the wrapped keys vmsnap builds itself (one
// CEK per checkpoint, ociimage/imgcrypt/jwe.go) for every kind of recipient set:
// an RSA key, an EC key (ECDH-ES+A256KW), and both, with each key. No
// guest: the layers are random chunks in an OCI layout.
func TestEncryptE2ESkopeoRecipients(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat("/usr/bin/skopeo"); err != nil {
		guest.SkipOrFail(t, "skopeo", "skopeo not installed (make deps)")
	}
	keys := t.TempDir()
	rsaPriv, rsaPub, _ := e2eKey(t, keys, "rsa", false)
	ecPriv, ecPub, _ := e2eKey(t, keys, "ec", true)
	parse := func(pub string) imgcrypt.Recipient {
		r, err := imgcrypt.ParseRecipient("jwe:" + pub)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	rsa, ec := parse(rsaPub), parse(ecPub)
	r := rand.New(rand.NewPCG(1, 2))
	for _, c := range []struct {
		name  string
		rcpt  []imgcrypt.Recipient
		privs []string
	}{
		{"rsa", []imgcrypt.Recipient{rsa}, []string{rsaPriv}},
		{"ec", []imgcrypt.Recipient{ec}, []string{ecPriv}},
		{"both", []imgcrypt.Recipient{rsa, ec}, []string{rsaPriv, ecPriv}},
	} {
		dir := t.TempDir()
		repo, err := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, imgcrypt.WithEncryption(imgcrypt.EncryptOptions{Recipients: c.rcpt}))
		if err != nil {
			t.Fatal(err)
		}
		var layers []ocispec.Descriptor
		var chunks [][]byte
		for range 3 {
			b := make([]byte, 50_000)
			for i := range b {
				b[i] = byte(r.Uint32())
			}
			d := ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromBytes(b), Size: int64(len(b)),
				Annotations: map[string]string{ociimage.AnnotationRawSize: strconv.Itoa(len(b))}}
			if err := repo.PutBlob(t.Context(), d, b); err != nil {
				t.Fatal(err)
			}
			layers, chunks = append(layers, d), append(chunks, b)
		}
		desc, err := ociimage.PushArtifact(t.Context(), repo, ociimage.Artifact{
			ArtifactType: ociimage.ArtifactTypeVMState, ConfigMediaType: ociimage.MediaTypeVMStateConfig,
			Config: map[string]string{"machine": "pc"}, Layers: layers,
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := ociimage.TagManifest(t.Context(), repo, desc, "x"); err != nil {
			t.Fatal(err)
		}
		for _, priv := range c.privs {
			out := filepath.Join(t.TempDir(), "out")
			if b, err := exec.Command("skopeo", "copy", "--decryption-key", priv, "oci:"+dir+":x", "oci:"+out+":x").CombinedOutput(); err != nil {
				t.Fatalf("%s recipients, key %s: skopeo copy: %v\n%s", c.name, filepath.Base(priv), err, b)
			}
			for i, l := range layers {
				b, err := os.ReadFile(filepath.Join(out, "blobs", "sha256", l.Digest.Encoded()))
				if err != nil || !bytes.Equal(b, chunks[i]) {
					t.Fatalf("%s recipients, key %s: layer %d not decrypted to its plaintext: %v", c.name, filepath.Base(priv), i, err)
				}
			}
		}
	}
}

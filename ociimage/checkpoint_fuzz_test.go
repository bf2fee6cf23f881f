package ociimage

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Placeholders of FuzzReadCheckpoint's index, replaced by the stored state
// and disk manifests' digests and sizes.
const (
	phState     = "@STATE@"
	phStateSize = "@STATE_SIZE@"
	phDisk      = "@DISK@"
	phDiskSize  = "@DISK_SIZE@"
)

// FuzzReadCheckpoint reads an index that is the fuzzer's (with
// placeholders for the state and disk manifests a layout holds) as a
// checkpoint, and opens each of its parts. A refusal carries a read code,
// never a panic; an accepted checkpoint has exactly one VM state part in
// its own repository, at most MaxCheckpointParts parts, and every link
// leads to a layout beside the index's (and, read from a registry, to the
// same registry), whatever the index says.
func FuzzReadCheckpoint(f *testing.F) {
	ctx := context.Background()
	dir := filepath.Join(f.TempDir(), "vm")
	repo := openFuzzLayout(f, dir)
	state, disk := twoParts(f, repo)
	entry := func(ph, phSize, part string) string {
		return `{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"` + ph + `","size":` + phSize +
			`,"annotations":{"dev.vmsnap.part":"` + part + `"}}`
	}
	head := `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[`
	marker := `"dev.vmsnap.checkpoint":"application/vnd.vmsnap.checkpoint.v1"`
	f.Add([]byte(head + entry(phState, phStateSize, "vmstate") + `,` + entry(phDisk, phDiskSize, "disk") + `],"annotations":{` + marker + `}}`))
	f.Add([]byte(head + entry(phState, phStateSize, "vmstate") + `],"annotations":{` + marker + `,"dev.vmsnap.disk.link":"vm-disk@` + phDisk + `"}}`))
	f.Add([]byte(head + entry(phState, phStateSize, "vmstate") + `],"annotations":{` + marker + `,"dev.vmsnap.disk.link":"../../etc@` + phDisk + `"}}`))
	f.Add([]byte(head + entry(phDisk, phDiskSize, "vmstate") + `,` + entry(phState, phStateSize, "disk") + `],"annotations":{` + marker + `}}`))
	f.Add([]byte(head + entry(phState, "-1", "vmstate") + `],"annotations":{` + marker + `}}`))
	f.Add([]byte(`{"schemaVersion":2,"manifests":null,"annotations":{` + marker + `}}`))
	f.Fuzz(func(t *testing.T, index []byte) {
		b := []byte(strings.NewReplacer(phState, state.Digest.String(), phStateSize, strconv.FormatInt(state.Size, 10),
			phDisk, disk.Digest.String(), phDiskSize, strconv.FormatInt(disk.Size, 10)).Replace(string(index)))
		if len(b) > MaxManifestSize {
			return
		}
		d := digest.FromBytes(b)
		if err := os.WriteFile(repo.blobPath(d), b, 0o644); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(repo.blobPath(d))
		desc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex, Digest: d, Size: int64(len(b))}
		c, err := ReadCheckpoint(ctx, repo, desc)
		wantReadCode(t, "ReadCheckpoint", err)
		if err != nil {
			return
		}
		checkCheckpoint(t, c, dir)
		for _, p := range c.Parts {
			_, err := c.Open(ctx, repo, p)
			wantReadCode(t, "opening part "+p.Name, err)
		}
		for _, key := range linkKeys {
			if link := c.Annotations[key]; link != "" {
				base := Reference{Registry: "reg.example:5000", Repository: "vms/vm"}
				if to, err := ResolveLink(base, link); err == nil && (to.Registry != base.Registry || to.IsLayout()) {
					t.Fatalf("%q read from a registry leads to %s", link, to)
				}
			}
		}
	})
}

// checkCheckpoint checks what every accepted checkpoint read from the
// layout dir holds.
func checkCheckpoint(t *testing.T, c *Checkpoint, dir string) {
	t.Helper()
	states := 0
	for _, p := range c.Parts {
		if p.Name == PartVMState {
			states++
			if p.Linked || !SameRepository(p.Ref, Reference{Layout: dir}) {
				t.Fatalf("the VM state part is at %s", p.Ref)
			}
		}
		if p.Linked && filepath.Dir(p.Ref.Layout) != filepath.Dir(dir) {
			t.Fatalf("a link leads to %s, not beside %s", p.Ref, dir)
		}
	}
	if states != 1 || len(c.Parts) > MaxCheckpointParts {
		t.Fatalf("an accepted checkpoint has %d VM state parts and %d parts", states, len(c.Parts))
	}
}

func openFuzzLayout(tb testing.TB, dir string) *Layout {
	tb.Helper()
	repo, err := Open(context.Background(), Reference{Layout: dir})
	if err != nil {
		tb.Fatal(err)
	}
	return repo.(*Layout)
}

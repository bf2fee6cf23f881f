package vmstate

import (
	"context"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// panickingRepo panics on every blob it is given, in the stream's upload
// workers: as a store with a bug in reading a registry's answer would.
type panickingRepo struct{ ociimage.Repository }

func (panickingRepo) PutBlob(context.Context, ocispec.Descriptor, []byte) error {
	var m map[string]int
	//lint:ignore SA5000 the write to a nil map is the panic under test
	m["boom"]++ // a nil map: a runtime error, as a real bug would be
	return nil
}

// A panic anywhere in a checkpoint, in its own goroutine or a worker's,
// while the VM is stopped or as the tags move, fails it as INTERNAL: the VM
// runs again and no tag names the partial snapshot.
func TestCheckpointPanicContinuesVMAndLeavesNoTag(t *testing.T) {
	boom := func() { panic("a bug") }
	for name, c := range map[string]struct {
		opts CheckpointOptions
		repo func(ociimage.Repository) ociimage.Repository
		want string
	}{
		"while the VM is stopped": {opts: CheckpointOptions{WhileStopped: func(context.Context) (Link, error) { boom(); return Link{}, nil }}, want: "a bug"},
		"as the tags move":        {opts: CheckpointOptions{Commit: func(context.Context, ocispec.Descriptor) error { boom(); return nil }}, want: "a bug"},
		"in an upload worker": {repo: func(r ociimage.Repository) ociimage.Repository { return panickingRepo{r} },
			want: "assignment to entry in nil map"},
	} {
		for _, mode := range []Mode{ModePause, ModeSnapshot} {
			t.Run(name+"/"+string(mode), func(t *testing.T) {
				q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 4<<20))
				dir := t.TempDir()
				var repo ociimage.Repository = openLayout(t, "oci:"+dir+":vm")
				if c.repo != nil {
					repo = c.repo(repo)
				}
				opts := c.opts
				opts.Mode, opts.Stream = mode, chunk.StreamOptions{ChunkSize: 1 << 20}
				res, err := Checkpoint(context.Background(), q.Dial(t), repo, opts)
				if res != nil || errcode.Of(err) != errcode.Internal {
					t.Fatalf("checkpoint = %+v, %v; want INTERNAL", res, err)
				}
				for _, want := range []string{c.want, "this is a bug in vmsnap", "the VM was continued"} {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("the error does not say %q: %v", want, err)
					}
				}
				if q.Status() != "running" {
					t.Fatalf("VM is %s after a checkpoint that panicked, want running", q.Status())
				}
				if _, err := openLayout(t, "oci:"+dir+":vm").Resolve(context.Background()); err == nil {
					t.Fatal("the tag names the snapshot of a checkpoint that panicked")
				}
			})
		}
	}
}

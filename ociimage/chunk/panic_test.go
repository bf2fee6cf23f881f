package chunk

import (
	"bytes"
	"context"
	"strings"
	"sync/atomic"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
)

// panickingSource panics on the third chunk it is asked for, in a decode
// worker: as a store with a bug in reading a registry's answer would.
type panickingSource struct {
	*chunkdata.Store
	n atomic.Int32
}

func (p *panickingSource) Blob(ctx context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	if p.n.Add(1) == 3 {
		var s []byte
		_ = s[len(desc.Digest)] // index out of range
	}
	return p.Store.Blob(ctx, desc, limit)
}

// A panic in a worker of either direction fails the stream as INTERNAL
// instead of ending the process.
func TestStreamWorkerPanicIsInternal(t *testing.T) {
	data := chunkdata.Stream(t, 6<<20)
	opts := StreamOptions{ChunkSize: 1 << 20, Workers: 2}
	store := chunkdata.NewStore()
	res, err := EncodeStream(context.Background(), bytes.NewReader(data), store, opts)
	if err != nil {
		t.Fatal(err)
	}
	_, err = DecodeStream(context.Background(), res.Layers, &panickingSource{Store: store}, &bytes.Buffer{}, opts)
	if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), "index out of range") {
		t.Fatalf("decoding through a panicking source: %v, want INTERNAL", err)
	}

	store.PutHook = func() error { panic("the sink has a bug") }
	_, err = EncodeStream(context.Background(), bytes.NewReader(chunkdata.Stream(t, 6<<20)), store, opts)
	if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), "the sink has a bug") {
		t.Fatalf("encoding into a panicking sink: %v, want INTERNAL", err)
	}
}

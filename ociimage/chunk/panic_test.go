package chunk

import (
	"bytes"
	"context"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// panickingSource panics on the third chunk it is asked for, in a decode
// worker: as a store with a bug in reading a registry's answer would.
type panickingSource struct {
	*memStore
	n int
}

func (p *panickingSource) Blob(ctx context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	p.mu.Lock()
	p.n++
	third := p.n == 3
	p.mu.Unlock()
	if third {
		var s []byte
		_ = s[len(desc.Digest)] // index out of range
	}
	return p.memStore.Blob(ctx, desc, limit)
}

// A panic in a worker of either direction fails the stream as INTERNAL
// instead of ending the process.
func TestStreamWorkerPanicIsInternal(t *testing.T) {
	data := testStream(t, 6<<20)
	opts := StreamOptions{ChunkSize: 1 << 20, Workers: 2}
	store := newMemStore()
	res, err := EncodeStream(context.Background(), bytes.NewReader(data), store, opts)
	if err != nil {
		t.Fatal(err)
	}
	_, err = DecodeStream(context.Background(), res.Layers, &panickingSource{memStore: store}, &bytes.Buffer{}, opts)
	if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), "index out of range") {
		t.Fatalf("decoding through a panicking source: %v, want INTERNAL", err)
	}

	store.putHook = func() error { panic("the sink has a bug") }
	_, err = EncodeStream(context.Background(), bytes.NewReader(testStream(t, 6<<20)), store, opts)
	if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), "the sink has a bug") {
		t.Fatalf("encoding into a panicking sink: %v, want INTERNAL", err)
	}
}

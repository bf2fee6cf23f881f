package chunk

import (
	"bytes"
	"context"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
)

// digestingStore is a chunkdata.Store that digests what it stores itself, as
// imgcrypt's encrypting store does, and remembers what it was handed.
type digestingStore struct {
	*chunkdata.Store
	mu          sync.Mutex
	handed      []ocispec.Descriptor
	putBlobUsed bool
}

func (d *digestingStore) AddUndigested(ctx context.Context, desc ocispec.Descriptor, data []byte) (ocispec.Descriptor, bool, error) {
	d.mu.Lock()
	d.handed = append(d.handed, desc)
	d.mu.Unlock()
	desc.Digest = digest.FromBytes(data)
	if have, _ := d.HasBlob(ctx, desc.Digest); have {
		return desc, false, nil
	}
	return desc, true, d.Store.PutBlob(ctx, desc, data)
}

func (d *digestingStore) PutBlob(context.Context, ocispec.Descriptor, []byte) error {
	d.mu.Lock()
	d.putBlobUsed = true
	d.mu.Unlock()
	return errcode.New(errcode.Internal, "PutBlob called on a sink that digests")
}

// A sink that digests as it stores gets every chunk undigested, and the
// stream's layers carry the digests it returned: the stream round-trips,
// and a chunk repeated in the stream is uploaded once.
func TestEncodeLeavesTheDigestToADigestingSink(t *testing.T) {
	rep := chunkdata.Random(7, 300<<10)
	data := bytes.Join([][]byte{chunkdata.Random(8, 1<<20), rep, rep, rep, chunkdata.Random(9, 1<<20)}, nil)
	store := &digestingStore{Store: chunkdata.NewStore()}
	opts := StreamOptions{ChunkSize: 64 << 10, Workers: 3}
	res, err := EncodeStream(context.Background(), bytes.NewReader(data), store, opts)
	if err != nil {
		t.Fatal(err)
	}
	if store.putBlobUsed {
		t.Fatal("EncodeStream used PutBlob on a sink that digests")
	}
	if len(store.handed) != len(res.Layers) {
		t.Fatalf("the sink was handed %d chunks for %d layers", len(store.handed), len(res.Layers))
	}
	for _, d := range store.handed {
		if d.Digest != "" {
			t.Fatalf("the sink was handed a digest (%s): the compressors digested the chunk too", d.Digest)
		}
	}
	if res.UploadedBytes >= res.StoredBytes {
		t.Fatalf("uploaded %d of %d stored bytes: the repeated chunks were uploaded again", res.UploadedBytes, res.StoredBytes)
	}
	var out bytes.Buffer
	if _, err := DecodeStream(context.Background(), res.Layers, store.Store, &out, opts); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), data) {
		t.Fatal("the stream did not round-trip through the digesting sink")
	}
}

package vmstate

// Test helpers shared with ociimage/chunk's tests (test packages cannot
// import each other's): a synthetic stream, random bytes, an in-memory
// blob store and a capped writer.

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	mrand "math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

func randomBytes(seed uint64, n int) []byte {
	r := mrand.New(mrand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// memStore is an in-memory BlobSink and BlobSource.
type memStore struct {
	mu    sync.Mutex
	blobs map[digest.Digest][]byte
	puts  atomic.Int64
	// putHook, if set, runs before every put; an error fails the put.
	putHook func() error
}

func newMemStore() *memStore { return &memStore{blobs: map[digest.Digest][]byte{}} }

func (m *memStore) HasBlob(_ context.Context, d digest.Digest) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.blobs[d]
	return ok, nil
}

func (m *memStore) PutBlob(_ context.Context, desc ocispec.Descriptor, data []byte) error {
	if m.putHook != nil {
		if err := m.putHook(); err != nil {
			return err
		}
	}
	m.puts.Add(1)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.blobs[desc.Digest] = bytes.Clone(data)
	return nil
}

// Blob verifies like a real store does.
func (m *memStore) Blob(_ context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.blobs[desc.Digest]
	if !ok {
		return nil, errcode.New(errcode.RegistryError, "no blob %s", desc.Digest)
	}
	if digest.FromBytes(b) != desc.Digest {
		return nil, errcode.New(errcode.DigestMismatch, "blob %s is corrupt", desc.Digest)
	}
	return bytes.Clone(b), nil
}

// testStream is part random (incompressible), part zeros, part repetitive,
// and not a multiple of any chunk size used.
func testStream(t testing.TB, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b[:n/3]); err != nil {
		t.Fatal(err)
	}
	for i := 2 * n / 3; i < n; i++ {
		b[i] = byte(i % 251)
	}
	return b
}

// capWriter fails past max bytes, so that a decoder that writes more than
// the chunks declare is caught rather than filling memory.
type capWriter struct {
	buf bytes.Buffer
	max int
}

func (w *capWriter) Write(p []byte) (int, error) {
	if w.buf.Len()+len(p) > w.max {
		return 0, errors.New("DecodeStream wrote more than the chunks declare")
	}
	return w.buf.Write(p)
}

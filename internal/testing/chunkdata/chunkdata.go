// Package chunkdata holds what the tests of the chunk codec and of its
// users (ociimage/chunk, vmstate) feed it and store it in: synthetic
// streams, an in-memory blob store that verifies like a real one, and a
// writer that fails past a bound. It is for tests only.
package chunkdata

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

// Random is n pseudo-random bytes, the same for the same seed.
func Random(seed uint64, n int) []byte {
	r := mrand.New(mrand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// Stream is part random (incompressible), part zeros, part repetitive,
// and not a multiple of any chunk size the tests use.
func Stream(t testing.TB, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b[:n/3]); err != nil {
		t.Fatal(err)
	}
	for i := 2 * n / 3; i < n; i++ {
		b[i] = byte(i % 251)
	}
	return b
}

// Store is an in-memory BlobSink and BlobSource. Tests may tamper with
// Blobs directly.
type Store struct {
	mu    sync.Mutex
	Blobs map[digest.Digest][]byte
	// Puts counts the blobs put.
	Puts atomic.Int64
	// PutHook, if set, runs before every put; an error fails the put.
	PutHook func() error
}

// NewStore returns an empty Store.
func NewStore() *Store { return &Store{Blobs: map[digest.Digest][]byte{}} }

// HasBlob says whether the store holds the blob.
func (m *Store) HasBlob(_ context.Context, d digest.Digest) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.Blobs[d]
	return ok, nil
}

// PutBlob stores a copy of data under desc's digest (unchecked, as a
// careless sink would).
func (m *Store) PutBlob(_ context.Context, desc ocispec.Descriptor, data []byte) error {
	if m.PutHook != nil {
		if err := m.PutHook(); err != nil {
			return err
		}
	}
	m.Puts.Add(1)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.Blobs[desc.Digest] = bytes.Clone(data)
	return nil
}

// Set stores b under d as it is: a tampered store, or a blob put behind
// the sink's back. It neither counts as a put nor runs PutHook.
func (m *Store) Set(d digest.Digest, b []byte) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.Blobs[d] = bytes.Clone(b)
}

// Blob verifies like a real store does.
func (m *Store) Blob(_ context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.Blobs[desc.Digest]
	if !ok {
		return nil, errcode.New(errcode.RegistryError, "no blob %s", desc.Digest)
	}
	if digest.FromBytes(b) != desc.Digest {
		return nil, errcode.New(errcode.DigestMismatch, "blob %s is corrupt", desc.Digest)
	}
	return bytes.Clone(b), nil
}

// CapWriter fails past Max bytes, so that a decoder that writes more than
// the chunks declare is caught rather than filling memory.
type CapWriter struct {
	Buf bytes.Buffer
	Max int
}

func (w *CapWriter) Write(p []byte) (int, error) {
	if w.Buf.Len()+len(p) > w.Max {
		return 0, errors.New("DecodeStream wrote more than the chunks declare")
	}
	return w.Buf.Write(p)
}

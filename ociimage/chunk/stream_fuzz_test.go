package chunk

// Adversarial chunks and records: zstd bombs, truncated and concatenated
// frames, lying size annotations, missing and duplicate layers, and
// arbitrary compatibility records. Every refusal carries a clear code.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"

	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
)

func zstdFrame(tb testing.TB, raw []byte) []byte {
	tb.Helper()
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderConcurrency(1))
	if err != nil {
		tb.Fatal(err)
	}
	defer enc.Close()
	return enc.EncodeAll(raw, nil)
}

// chunkLayer stores data in store as a chunk declaring rawSize ("" leaves
// the annotation out).
func chunkLayer(store *chunkdata.Store, data []byte, rawSize string) ocispec.Descriptor {
	d := ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromBytes(data), Size: int64(len(data)), Annotations: map[string]string{}}
	if rawSize != "" {
		d.Annotations[ociimage.AnnotationRawSize] = rawSize
	}
	store.Set(d.Digest, data)
	return d
}

// skippableFrame is a zstd skippable frame holding payload.
func skippableFrame(payload []byte) []byte {
	b := binary.LittleEndian.AppendUint32(nil, 0x184D2A50)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(payload)))
	return append(b, payload...)
}

// decodeCodes are the codes DecodeStream may fail with on hostile chunks.
var decodeCodes = map[errcode.Code]bool{errcode.InvalidInput: true, errcode.DigestMismatch: true, errcode.RegistryError: true}

func TestDecodeStreamHostileChunks(t *testing.T) {
	small := bytes.Repeat([]byte("vmsnap"), 700) // 4200 bytes
	frame := zstdFrame(t, small)
	bomb := zstdFrame(t, make([]byte, ociimage.MaxChunkSize)) // 64 MiB of zeros in a few KiB
	overLimit := zstdFrame(t, make([]byte, ociimage.MaxChunkSize+1))
	// A frame whose header asks for a 128 MiB window (more than the decoder
	// may use): window descriptor exponent 17 -> 2^(10+17).
	hugeWindow := append([]byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, 17 << 3}, 0x01, 0x00, 0x00) // then an empty last raw block
	concat := append(append([]byte{}, frame...), frame...)

	cases := []struct {
		name   string
		layers func(s *chunkdata.Store) []ocispec.Descriptor
		code   errcode.Code // "" means success
		want   []byte
		says   string
	}{
		{"one frame", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, "4200")}
		}, "", small, ""},
		{"bomb declaring 4200 bytes", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, bomb, "4200")}
		}, errcode.InvalidInput, nil, "declared 4200"},
		{"bomb declaring 1 byte", func(s *chunkdata.Store) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, bomb, "1")} }, errcode.InvalidInput, nil, ""},
		{"frame over the chunk limit", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, overLimit, strconv.Itoa(ociimage.MaxChunkSize))}
		}, errcode.InvalidInput, nil, ""},
		{"declares more than it holds", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, "4201")}
		}, errcode.InvalidInput, nil, "decompresses to 4200"},
		{"declares less than it holds", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, "4199")}
		}, errcode.InvalidInput, nil, ""},
		{"truncated frame", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame[:len(frame)-3], "4200")}
		}, errcode.InvalidInput, nil, ""},
		{"frame header only", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame[:6], "4200")}
		}, errcode.InvalidInput, nil, ""},
		{"not zstd", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, []byte("gzip? \x1f\x8b"), "5")}
		}, errcode.InvalidInput, nil, ""},
		{"concatenated frames as declared", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, concat, "8400")}
		}, "", append(bytes.Clone(small), small...), ""},
		{"concatenated frames over declared", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, concat, "4200")}
		}, errcode.InvalidInput, nil, ""},
		{"frame then a bomb", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, append(bytes.Clone(frame), bomb...), "8400")}
		}, errcode.InvalidInput, nil, ""},
		{"frame then garbage", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, append(bytes.Clone(frame), "trailing garbage"...), "4200")}
		}, errcode.InvalidInput, nil, ""},
		{"skippable frame around a frame", func(s *chunkdata.Store) []ocispec.Descriptor {
			b := append(skippableFrame([]byte("meta")), frame...)
			return []ocispec.Descriptor{chunkLayer(s, append(b, skippableFrame(nil)...), "4200")}
		}, "", small, ""},
		{"only a skippable frame", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, skippableFrame([]byte("x")), "1")}
		}, errcode.InvalidInput, nil, ""},
		{"window over the memory limit", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, hugeWindow, "1")}
		}, errcode.InvalidInput, nil, ""},
		{"no raw size", func(s *chunkdata.Store) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, "")} }, errcode.InvalidInput, nil, "annotation"},
		{"raw size 0", func(s *chunkdata.Store) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, "0")} }, errcode.InvalidInput, nil, "raw size"},
		{"raw size negative", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, "-4200")}
		}, errcode.InvalidInput, nil, "raw size"},
		{"raw size huge", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, "9223372036854775807")}
		}, errcode.InvalidInput, nil, "raw size"},
		{"raw size overflowing", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, "99999999999999999999")}
		}, errcode.InvalidInput, nil, "raw size"},
		{"raw size hex", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, "0x1068")}
		}, errcode.InvalidInput, nil, "raw size"},
		{"raw size with space", func(s *chunkdata.Store) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, " 4200")}
		}, errcode.InvalidInput, nil, "raw size"},
		{"missing layer", func(s *chunkdata.Store) []ocispec.Descriptor {
			d := chunkLayer(chunkdata.NewStore(), frame, "4200") // stored elsewhere
			return []ocispec.Descriptor{chunkLayer(s, frame, "4200"), {MediaType: d.MediaType, Digest: digest.FromString("gone"), Size: d.Size, Annotations: d.Annotations}}
		}, errcode.RegistryError, nil, "no blob"},
		{"duplicate layers are a repeated chunk", func(s *chunkdata.Store) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			return []ocispec.Descriptor{d, d, d}
		}, "", bytes.Repeat(small, 3), ""},
		{"duplicate layers with offsets", func(s *chunkdata.Store) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.Annotations[ociimage.AnnotationRawOffset] = "0"
			return []ocispec.Descriptor{d, d}
		}, errcode.InvalidInput, nil, "offset"},
		{"digest of other bytes", func(s *chunkdata.Store) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			s.Set(d.Digest, bytes.Repeat([]byte{0}, len(frame))) // tampered store that does not verify
			return []ocispec.Descriptor{d}
		}, errcode.DigestMismatch, nil, ""},
		{"wrong media type", func(s *chunkdata.Store) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.MediaType = ocispec.MediaTypeImageLayerZstd
			return []ocispec.Descriptor{d}
		}, errcode.InvalidInput, nil, "media type"},
		{"size 0", func(s *chunkdata.Store) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.Size = 0
			return []ocispec.Descriptor{d}
		}, errcode.InvalidInput, nil, "declares 0 bytes"},
		{"size over the limit", func(s *chunkdata.Store) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.Size = ociimage.MaxChunkSize + 1
			return []ocispec.Descriptor{d}
		}, errcode.InvalidInput, nil, "declares"},
		{"digest with a path", func(s *chunkdata.Store) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.Digest = "sha256:../../etc/passwd"
			return []ocispec.Descriptor{d}
		}, errcode.InvalidInput, nil, "layer 0"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			store := chunkdata.NewStore()
			layers := tc.layers(store)
			out := &chunkdata.CapWriter{Max: 64 << 20}
			var ms0, ms1 runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&ms0)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			start := time.Now()
			n, err := DecodeStream(ctx, layers, store, out, StreamOptions{Workers: 2})
			elapsed := time.Since(start)
			runtime.ReadMemStats(&ms1)
			if tc.code == "" {
				if err != nil || n != int64(len(tc.want)) || !bytes.Equal(out.Buf.Bytes(), tc.want) {
					t.Fatalf("DecodeStream = %d, %v; want %d bytes", n, err, len(tc.want))
				}
			} else {
				if errcode.Of(err) != tc.code || !strings.Contains(err.Error(), tc.says) {
					t.Fatalf("DecodeStream = %v (code %s), want %s saying %q", err, errcode.Of(err), tc.code, tc.says)
				}
				if ctx.Err() != nil {
					t.Fatal("DecodeStream only ended at the deadline")
				}
			}
			// The bomb must not be inflated: about the declared size is
			// allocated per chunk, not the 64 MiB it expands to.
			if strings.HasPrefix(tc.name, "bomb") {
				if alloc := ms1.TotalAlloc - ms0.TotalAlloc; alloc > 16<<20 {
					t.Errorf("decoding a bomb declaring %s bytes allocated %d MiB", layers[0].Annotations[ociimage.AnnotationRawSize], alloc>>20)
				}
			}
			if elapsed > 5*time.Second {
				t.Errorf("took %v", elapsed)
			}
		})
	}
}

// FuzzDecodeStream feeds arbitrary chunk bytes, with a digest that matches
// them (so they reach the decompressor) and an arbitrary declared raw size,
// through DecodeStream. It must write exactly the declared bytes or fail
// with a code, and never write more than declared.
func FuzzDecodeStream(f *testing.F) {
	// Seeds from real data: chunks EncodeStream makes of a state-like stream.
	store := chunkdata.NewStore()
	res, err := EncodeStream(context.Background(), bytes.NewReader(chunkdata.Stream(f, 96<<10)), store, StreamOptions{ChunkSize: 32 << 10, Workers: 2})
	if err != nil {
		f.Fatal(err)
	}
	for _, l := range res.Layers {
		b := store.Blobs[l.Digest]
		f.Add(b, l.Annotations[ociimage.AnnotationRawSize], []byte(nil), "")
	}
	first := store.Blobs[res.Layers[0].Digest]
	second := store.Blobs[res.Layers[1].Digest]
	f.Add(first, "32768", second, "32768")
	f.Add(first[:len(first)/2], "32768", second, "32768")
	f.Add(append(bytes.Clone(first), first...), "65536", []byte(nil), "")
	f.Add(zstdFrame(f, make([]byte, 1<<20)), "100", []byte(nil), "")
	f.Add(append(skippableFrame([]byte("x")), zstdFrame(f, []byte("hello"))...), "5", []byte("\x28\xb5\x2f\xfd"), "1")

	f.Fuzz(func(t *testing.T, a []byte, rawA string, b []byte, rawB string) {
		s := chunkdata.NewStore()
		layers := []ocispec.Descriptor{chunkLayer(s, a, rawA)}
		if len(b) > 0 || rawB != "" {
			layers = append(layers, chunkLayer(s, b, rawB))
		}
		total, verr := ValidateLayers(layers)
		out := &chunkdata.CapWriter{Max: 2 * ociimage.MaxChunkSize}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		n, err := DecodeStream(ctx, layers, s, out, StreamOptions{Workers: 2})
		if ctx.Err() != nil {
			t.Fatal("DecodeStream ran into the deadline")
		}
		if err != nil {
			if !decodeCodes[errcode.Of(err)] {
				t.Fatalf("DecodeStream: %v (code %s)", err, errcode.Of(err))
			}
			if int64(out.Buf.Len()) != n || n > total {
				t.Fatalf("failed DecodeStream wrote %d bytes, reported %d, of %d declared", out.Buf.Len(), n, total)
			}
			return
		}
		if verr != nil {
			t.Fatalf("DecodeStream accepted layers ValidateLayers refuses: %v", verr)
		}
		if n != total || int64(out.Buf.Len()) != total {
			t.Fatalf("DecodeStream wrote %d (reported %d), declared %d", out.Buf.Len(), n, total)
		}
		// What came out is what zstd makes of the chunks.
		dec, _ := zstd.NewReader(nil, zstd.WithDecoderMaxMemory(ociimage.MaxChunkSize))
		defer dec.Close()
		want, _ := dec.DecodeAll(a, nil)
		if len(layers) > 1 {
			wb, _ := dec.DecodeAll(b, nil)
			want = append(want, wb...)
		}
		if !bytes.Equal(want, out.Buf.Bytes()) {
			t.Fatalf("DecodeStream output differs from zstd's")
		}
	})
}

// FuzzValidateLayers: any layer list, as JSON, either validates with a
// total within bounds or is refused as INVALID_INPUT.
func FuzzValidateLayers(f *testing.F) {
	store := chunkdata.NewStore()
	res, err := EncodeStream(context.Background(), bytes.NewReader(chunkdata.Stream(f, 40<<10)), store, StreamOptions{ChunkSize: 16 << 10, Workers: 2})
	if err != nil {
		f.Fatal(err)
	}
	b, _ := json.Marshal(res.Layers)
	f.Add(b)
	f.Add([]byte(`[{"mediaType":"application/vnd.vmsnap.chunk.v1.raw+zstd","digest":"sha256:../../x","size":1,"annotations":{"dev.vmsnap.chunk.raw-size":"1"}}]`))
	f.Add([]byte(`[{"mediaType":"application/vnd.vmsnap.chunk.v1.raw+zstd","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":-1}]`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var layers []ocispec.Descriptor
		if json.Unmarshal(b, &layers) != nil {
			return
		}
		total, err := ValidateLayers(layers)
		if err != nil {
			if errcode.Of(err) != errcode.InvalidInput {
				t.Fatalf("ValidateLayers: %v (code %s)", err, errcode.Of(err))
			}
			return
		}
		if total < 0 || total > int64(len(layers))*ociimage.MaxChunkSize {
			t.Fatalf("total %d for %d layers", total, len(layers))
		}
		for _, l := range layers {
			if l.Digest.Validate() != nil || strings.ContainsAny(l.Digest.Encoded(), "/\\.") {
				t.Fatalf("accepted digest %q", l.Digest)
			}
		}
	})
}

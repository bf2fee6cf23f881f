package vmstate

// Adversarial chunks and records: zstd bombs, truncated and concatenated
// frames, lying size annotations, missing and duplicate layers, and
// arbitrary compatibility records. Every refusal carries a clear code.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"

	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
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
func chunkLayer(store *memStore, data []byte, rawSize string) ocispec.Descriptor {
	d := ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromBytes(data), Size: int64(len(data)), Annotations: map[string]string{}}
	if rawSize != "" {
		d.Annotations[ociimage.AnnotationRawSize] = rawSize
	}
	store.mu.Lock()
	store.blobs[d.Digest] = bytes.Clone(data)
	store.mu.Unlock()
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
		layers func(s *memStore) []ocispec.Descriptor
		code   errcode.Code // "" means success
		want   []byte
		says   string
	}{
		{"one frame", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, "4200")} }, "", small, ""},
		{"bomb declaring 4200 bytes", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, bomb, "4200")} }, errcode.InvalidInput, nil, "declared 4200"},
		{"bomb declaring 1 byte", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, bomb, "1")} }, errcode.InvalidInput, nil, ""},
		{"frame over the chunk limit", func(s *memStore) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, overLimit, strconv.Itoa(ociimage.MaxChunkSize))}
		}, errcode.InvalidInput, nil, ""},
		{"declares more than it holds", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, "4201")} }, errcode.InvalidInput, nil, "decompresses to 4200"},
		{"declares less than it holds", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, "4199")} }, errcode.InvalidInput, nil, ""},
		{"truncated frame", func(s *memStore) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame[:len(frame)-3], "4200")}
		}, errcode.InvalidInput, nil, ""},
		{"frame header only", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame[:6], "4200")} }, errcode.InvalidInput, nil, ""},
		{"not zstd", func(s *memStore) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, []byte("gzip? \x1f\x8b"), "5")}
		}, errcode.InvalidInput, nil, ""},
		{"concatenated frames as declared", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, concat, "8400")} }, "", append(bytes.Clone(small), small...), ""},
		{"concatenated frames over declared", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, concat, "4200")} }, errcode.InvalidInput, nil, ""},
		{"frame then a bomb", func(s *memStore) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, append(bytes.Clone(frame), bomb...), "8400")}
		}, errcode.InvalidInput, nil, ""},
		{"frame then garbage", func(s *memStore) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, append(bytes.Clone(frame), "trailing garbage"...), "4200")}
		}, errcode.InvalidInput, nil, ""},
		{"skippable frame around a frame", func(s *memStore) []ocispec.Descriptor {
			b := append(skippableFrame([]byte("meta")), frame...)
			return []ocispec.Descriptor{chunkLayer(s, append(b, skippableFrame(nil)...), "4200")}
		}, "", small, ""},
		{"only a skippable frame", func(s *memStore) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, skippableFrame([]byte("x")), "1")}
		}, errcode.InvalidInput, nil, ""},
		{"window over the memory limit", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, hugeWindow, "1")} }, errcode.InvalidInput, nil, ""},
		{"no raw size", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, "")} }, errcode.InvalidInput, nil, "annotation"},
		{"raw size 0", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, "0")} }, errcode.InvalidInput, nil, "raw size"},
		{"raw size negative", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, "-4200")} }, errcode.InvalidInput, nil, "raw size"},
		{"raw size huge", func(s *memStore) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, "9223372036854775807")}
		}, errcode.InvalidInput, nil, "raw size"},
		{"raw size overflowing", func(s *memStore) []ocispec.Descriptor {
			return []ocispec.Descriptor{chunkLayer(s, frame, "99999999999999999999")}
		}, errcode.InvalidInput, nil, "raw size"},
		{"raw size hex", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, "0x1068")} }, errcode.InvalidInput, nil, "raw size"},
		{"raw size with space", func(s *memStore) []ocispec.Descriptor { return []ocispec.Descriptor{chunkLayer(s, frame, " 4200")} }, errcode.InvalidInput, nil, "raw size"},
		{"missing layer", func(s *memStore) []ocispec.Descriptor {
			d := chunkLayer(newMemStore(), frame, "4200") // stored elsewhere
			return []ocispec.Descriptor{chunkLayer(s, frame, "4200"), {MediaType: d.MediaType, Digest: digest.FromString("gone"), Size: d.Size, Annotations: d.Annotations}}
		}, errcode.RegistryError, nil, "no blob"},
		{"duplicate layers are a repeated chunk", func(s *memStore) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			return []ocispec.Descriptor{d, d, d}
		}, "", bytes.Repeat(small, 3), ""},
		{"duplicate layers with offsets", func(s *memStore) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.Annotations[ociimage.AnnotationRawOffset] = "0"
			return []ocispec.Descriptor{d, d}
		}, errcode.InvalidInput, nil, "offset"},
		{"digest of other bytes", func(s *memStore) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			s.blobs[d.Digest] = bytes.Repeat([]byte{0}, len(frame)) // tampered store that does not verify
			return []ocispec.Descriptor{d}
		}, errcode.DigestMismatch, nil, ""},
		{"wrong media type", func(s *memStore) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.MediaType = ocispec.MediaTypeImageLayerZstd
			return []ocispec.Descriptor{d}
		}, errcode.InvalidInput, nil, "media type"},
		{"size 0", func(s *memStore) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.Size = 0
			return []ocispec.Descriptor{d}
		}, errcode.InvalidInput, nil, "declares 0 bytes"},
		{"size over the limit", func(s *memStore) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.Size = ociimage.MaxChunkSize + 1
			return []ocispec.Descriptor{d}
		}, errcode.InvalidInput, nil, "declares"},
		{"digest with a path", func(s *memStore) []ocispec.Descriptor {
			d := chunkLayer(s, frame, "4200")
			d.Digest = "sha256:../../etc/passwd"
			return []ocispec.Descriptor{d}
		}, errcode.InvalidInput, nil, "layer 0"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			store := newMemStore()
			layers := tc.layers(store)
			out := &capWriter{max: 64 << 20}
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
				if err != nil || n != int64(len(tc.want)) || !bytes.Equal(out.buf.Bytes(), tc.want) {
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
	store := newMemStore()
	res, err := EncodeStream(context.Background(), bytes.NewReader(testStream(f, 96<<10)), store, StreamOptions{ChunkSize: 32 << 10, Workers: 2})
	if err != nil {
		f.Fatal(err)
	}
	for _, l := range res.Layers {
		b := store.blobs[l.Digest]
		f.Add(b, l.Annotations[ociimage.AnnotationRawSize], []byte(nil), "")
	}
	first := store.blobs[res.Layers[0].Digest]
	second := store.blobs[res.Layers[1].Digest]
	f.Add(first, "32768", second, "32768")
	f.Add(first[:len(first)/2], "32768", second, "32768")
	f.Add(append(bytes.Clone(first), first...), "65536", []byte(nil), "")
	f.Add(zstdFrame(f, make([]byte, 1<<20)), "100", []byte(nil), "")
	f.Add(append(skippableFrame([]byte("x")), zstdFrame(f, []byte("hello"))...), "5", []byte("\x28\xb5\x2f\xfd"), "1")

	f.Fuzz(func(t *testing.T, a []byte, rawA string, b []byte, rawB string) {
		s := newMemStore()
		layers := []ocispec.Descriptor{chunkLayer(s, a, rawA)}
		if len(b) > 0 || rawB != "" {
			layers = append(layers, chunkLayer(s, b, rawB))
		}
		total, verr := ValidateLayers(layers)
		out := &capWriter{max: 2 * ociimage.MaxChunkSize}
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
			if int64(out.buf.Len()) != n || n > total {
				t.Fatalf("failed DecodeStream wrote %d bytes, reported %d, of %d declared", out.buf.Len(), n, total)
			}
			return
		}
		if verr != nil {
			t.Fatalf("DecodeStream accepted layers ValidateLayers refuses: %v", verr)
		}
		if n != total || int64(out.buf.Len()) != total {
			t.Fatalf("DecodeStream wrote %d (reported %d), declared %d", out.buf.Len(), n, total)
		}
		// What came out is what zstd makes of the chunks.
		dec, _ := zstd.NewReader(nil, zstd.WithDecoderMaxMemory(ociimage.MaxChunkSize))
		defer dec.Close()
		want, _ := dec.DecodeAll(a, nil)
		if len(layers) > 1 {
			wb, _ := dec.DecodeAll(b, nil)
			want = append(want, wb...)
		}
		if !bytes.Equal(want, out.buf.Bytes()) {
			t.Fatalf("DecodeStream output differs from zstd's")
		}
	})
}

// FuzzValidateLayers: any layer list, as JSON, either validates with a
// total within bounds or is refused as INVALID_INPUT.
func FuzzValidateLayers(f *testing.F) {
	store := newMemStore()
	res, err := EncodeStream(context.Background(), bytes.NewReader(testStream(f, 40<<10)), store, StreamOptions{ChunkSize: 16 << 10, Workers: 2})
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

// FuzzRecord decodes an arbitrary compatibility record the way restore
// does (strictly, as part of the config) and validates and compares it.
func FuzzRecord(f *testing.F) {
	real, _ := json.Marshal(sampleRecord())
	f.Add(real, real)
	other := sampleRecord()
	other.QEMUVersion, other.CPUs, other.Devices = "6.2.0", 4, append(other.Devices, "00:03.0 8086:100e class=0200 id=net0")
	other.DevicesHash = devicesDigest(other.Devices)
	ob, _ := json.Marshal(other)
	f.Add(real, ob)
	f.Add([]byte(`{"qemuVersion":"99999999999999999999.1","arch":"x","machine":"m","cpus":1,"memoryBytes":1,"devicesDigest":"`+devicesDigest(nil)+`"}`), real)
	f.Add([]byte(`{"qemuVersion":"7..2","cpus":-1,"memoryBytes":-9223372036854775808,"blocks":[{},{}]}`), real)
	f.Fuzz(func(t *testing.T, a, b []byte) {
		decode := func(data []byte) (Record, bool) {
			dec := json.NewDecoder(bytes.NewReader(data))
			dec.DisallowUnknownFields()
			var r Record
			return r, dec.Decode(&r) == nil
		}
		src, ok := decode(a)
		if !ok {
			return
		}
		if err := src.Validate(); err != nil {
			if errcode.Of(err) != errcode.InvalidInput {
				t.Fatalf("Validate: %v (code %s)", err, errcode.Of(err))
			}
			return
		}
		// A record is always compatible with itself.
		if d := Compare(src, src); len(d) != 0 {
			t.Fatalf("a record differs from itself: %q", d)
		}
		target, ok := decode(b)
		if !ok {
			return
		}
		err := CheckCompatible(src, target)
		if err != nil && (errcode.Of(err) != errcode.CompatMismatch || len(errcode.DetailsOf(err)) == 0) {
			t.Fatalf("CheckCompatible: %v (code %s)", err, errcode.Of(err))
		}
	})
}

// TestLoadConfigAndDecodeRealLayoutWithHostileLayers pushes a real stream
// into a layout and rewrites its manifest with missing, duplicated and
// oversized layers: LoadConfig or DecodeStream refuse each with a code, and
// nothing is written outside the target directory.
func TestLoadConfigAndDecodeRealLayoutWithHostileLayers(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	dir := filepath.Join(root, "layout")
	data := testStream(t, 200<<10)
	repo := openLayout(t, "oci:"+dir+":vm")
	res, err := EncodeStream(ctx, bytes.NewReader(data), repo, StreamOptions{ChunkSize: 64 << 10, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	rec := sampleRecord()
	cfg := Config{Record: rec, Mode: ModePause, RawBytes: res.RawBytes, Compression: "zstd", ChunkSize: 64 << 10}
	push := func(tag string, layers []ocispec.Descriptor, c any) {
		t.Helper()
		// By hand, as another tool could: PushArtifact refuses some of these.
		b, _ := json.Marshal(c)
		cd := ocispec.Descriptor{MediaType: ociimage.MediaTypeVMStateConfig, Digest: digest.FromBytes(b), Size: int64(len(b))}
		r := openLayout(t, "oci:"+dir+":"+tag)
		if err := r.PutBlob(ctx, cd, b); err != nil {
			t.Fatal(err)
		}
		for _, l := range layers {
			if ok, _ := r.HasBlob(ctx, l.Digest); !ok {
				// A stand-in of the right size so that PutManifest stores
				// the manifest; its digest is wrong.
				os.WriteFile(filepath.Join(dir, "blobs", "sha256", l.Digest.Encoded()), bytes.Repeat([]byte("x"), int(l.Size)), 0o644)
			}
		}
		if _, err := r.PutManifest(ctx, ocispec.Manifest{ArtifactType: ociimage.ArtifactTypeVMState, Config: cd, Layers: layers}); err != nil {
			t.Fatalf("%s: %v", tag, err)
		}
	}
	withRaw := func(l ocispec.Descriptor, raw string) ocispec.Descriptor {
		l.Annotations = map[string]string{ociimage.AnnotationRawSize: raw}
		return l
	}
	L := res.Layers
	raw0, _ := strconv.Atoi(L[0].Annotations[ociimage.AnnotationRawSize]) // the first chunk's size (content-defined)
	r0 := strconv.Itoa(raw0)
	missing := withRaw(ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromString("missing"), Size: 10}, "10")
	cases := []struct {
		tag    string
		layers []ocispec.Descriptor
		cfg    func(c *Config)
		code   errcode.Code
		stage  string // "load" or "decode"
		remove bool   // remove the stand-in blob after the push: a missing chunk
	}{
		{"real", L, nil, "", "", false},
		{"no-layers", []ocispec.Descriptor{}, func(c *Config) { c.RawBytes = 0 }, errcode.InvalidInput, "load", false},
		{"duplicate-with-offsets", append(append([]ocispec.Descriptor{}, L...), L[0]), nil, errcode.InvalidInput, "load", false},
		{"dropped-layer", L[1:], nil, errcode.InvalidInput, "load", false},
		{"rawbytes-lies", L, func(c *Config) { c.RawBytes++ }, errcode.InvalidInput, "load", false},
		{"bad-record", L, func(c *Config) { c.Record.DevicesHash = "sha256:00" }, errcode.InvalidInput, "load", false},
		{"no-cpus", L, func(c *Config) { c.Record.CPUs = 0 }, errcode.InvalidInput, "load", false},
		{"corrupt-blob", []ocispec.Descriptor{withRaw(L[0], r0), missing}, func(c *Config) { c.RawBytes = int64(raw0) + 10 }, errcode.DigestMismatch, "decode", false},
		{"missing-blob", []ocispec.Descriptor{withRaw(L[0], r0), missing}, func(c *Config) { c.RawBytes = int64(raw0) + 10 }, errcode.RegistryError, "decode", true},
		{"raw-size-lies", []ocispec.Descriptor{withRaw(L[0], strconv.Itoa(raw0+1))}, func(c *Config) { c.RawBytes = int64(raw0) + 1 }, errcode.InvalidInput, "decode", false},
	}
	for _, tc := range cases {
		t.Run(tc.tag, func(t *testing.T) {
			c := cfg
			if tc.cfg != nil {
				tc.cfg(&c)
			}
			push(tc.tag, tc.layers, c)
			if tc.remove {
				os.Remove(filepath.Join(dir, "blobs", "sha256", missing.Digest.Encoded()))
			}
			before := dirList(t, root)
			r := openLayout(t, "oci:"+dir+":"+tc.tag)
			_, m, _, err := LoadConfig(ctx, r)
			if tc.stage == "load" {
				if errcode.Of(err) != tc.code {
					t.Fatalf("LoadConfig = %v (code %s), want %s", err, errcode.Of(err), tc.code)
				}
				return
			}
			if err != nil {
				t.Fatalf("LoadConfig: %v", err)
			}
			out := &capWriter{max: len(data) + 1}
			_, err = DecodeStream(ctx, m.Layers, r, out, StreamOptions{Workers: 2})
			if errcode.Of(err) != tc.code {
				t.Fatalf("DecodeStream = %v (code %s), want %s", err, errcode.Of(err), tc.code)
			}
			if tc.code == "" && !bytes.Equal(out.buf.Bytes(), data) {
				t.Fatal("round trip differs")
			}
			if after := dirList(t, root); after != before {
				t.Fatalf("reading changed the tree:\n%s\n->\n%s", before, after)
			}
		})
	}
}

func dirList(t *testing.T, root string) string {
	var b strings.Builder
	filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err == nil {
			if fi.IsDir() {
				b.WriteString(p + "/\n")
			} else {
				b.WriteString(p + " " + strconv.FormatInt(fi.Size(), 10) + " " + fi.ModTime().String() + "\n")
			}
		}
		return nil
	})
	return b.String()
}

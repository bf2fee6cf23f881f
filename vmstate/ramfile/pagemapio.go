package ramfile

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"io"

	"github.com/klauspost/compress/zstd"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// entry is one page's line of a page map (fast 0: a page of zeros).
type entry struct {
	fast   uint64
	strong strongHash
}

func newMapDecoder() (*zstd.Decoder, error) {
	dec, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(8<<20), zstd.WithDecoderMaxMemory(64<<20))
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "zstd decoder")
	}
	return dec, nil
}

func readEntry(r *bufio.Reader) (entry, bool) {
	var b [entrySize]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return entry{}, false
	}
	return entry{fast: binary.LittleEndian.Uint64(b[:8]), strong: strongHash(b[8:])}, true
}

// entryReader reads an image's page map, one page's entry at a time, from
// its layers: each is fetched (its digest verified) when its first page is
// read and decompressed as a stream. What it holds is one compressed layer
// and a buffer, whatever RAM size the image declares.
type entryReader struct {
	ctx    context.Context
	src    chunk.BlobSource
	layers []ocispec.Descriptor // those not read yet
	pages  int
	dec    *zstd.Decoder
	r      *bufio.Reader
	cur    ocispec.Descriptor
	next   int // the page whose entry read returns next
	end    int // the end of the current layer's pages
}

func newEntryReader(ctx context.Context, layers []ocispec.Descriptor, src chunk.BlobSource, pages int) (*entryReader, error) {
	dec, err := newMapDecoder()
	if err != nil {
		return nil, err
	}
	return &entryReader{ctx: ctx, src: src, layers: layers, pages: pages, dec: dec}, nil
}

func (er *entryReader) close() { er.dec.Close() }

func (er *entryReader) bad() error {
	return errcode.New(errcode.InvalidInput, "page map layer %s does not decompress to the entries of pages %d..%d", er.cur.Digest, er.next, er.end)
}

// read returns the entry of page er.next.
func (er *entryReader) read() (entry, error) {
	for er.next == er.end {
		if err := er.nextLayer(); err != nil {
			return entry{}, err
		}
	}
	e, ok := readEntry(er.r)
	if !ok {
		return entry{}, er.bad()
	}
	er.next++
	return e, nil
}

// nextLayer starts the layer that holds page er.next, once the current one
// has ended exactly.
func (er *entryReader) nextLayer() error {
	if err := er.layerEnded(); err != nil {
		return err
	}
	if len(er.layers) == 0 {
		return errcode.New(errcode.InvalidInput, "the page map covers %d of the RAM file's %d pages", er.next, er.pages)
	}
	l := er.layers[0]
	er.layers = er.layers[1:]
	first, count, err := pageMapRange(l)
	if err != nil {
		return err
	}
	if first != er.next || first+count > er.pages {
		return errcode.New(errcode.InvalidInput, "page map layer %s covers pages %d+%d, want the next from page %d of %d", l.Digest, first, count, er.next, er.pages)
	}
	data, err := er.src.Blob(er.ctx, l, l.Size)
	if err != nil {
		return err
	}
	er.cur, er.end = l, first+count
	if err := er.dec.Reset(bytes.NewReader(data)); err != nil {
		return er.bad()
	}
	if er.r == nil {
		er.r = bufio.NewReaderSize(er.dec, 64<<10)
	} else {
		er.r.Reset(er.dec)
	}
	return nil
}

func (er *entryReader) layerEnded() error {
	if er.r != nil {
		if _, err := er.r.ReadByte(); err != io.EOF {
			return er.bad()
		}
	}
	return nil
}

// finish checks that the map ended with the RAM file's last page.
func (er *entryReader) finish() error {
	if er.next != er.pages || len(er.layers) > 0 {
		return errcode.New(errcode.InvalidInput, "the page map covers %d of the RAM file's %d pages", er.next+len(er.layers), er.pages)
	}
	return er.layerEnded()
}

// LoadPageMap fetches and verifies a RAM file's page map. It holds the
// entries of the map's data pages (24 bytes each): call it only for a map
// whose size is bounded by something real (the memory of the VM being
// checkpointed), never for an image's declared size alone (Verify streams
// instead).
func LoadPageMap(ctx context.Context, layers Layers, src chunk.BlobSource, size int64) (*PageMap, error) {
	pages := Pages(size)
	er, err := newEntryReader(ctx, layers.PageMap, src, pages)
	if err != nil {
		return nil, err
	}
	defer er.close()
	m := newPageMap(pages)
	for i := range pages {
		e, err := er.read()
		if err != nil {
			return nil, err
		}
		m.addEntry(i, e)
	}
	if err := er.finish(); err != nil {
		return nil, err
	}
	m.finish()
	return m, nil
}

// EncodePageMap is m as one compressed stream of its entries: how a node
// keeps the map of a checkpoint it recorded (DecodePageMap reads it).
func EncodePageMap(m *PageMap) ([]byte, error) {
	enc, err := chunk.NewEncoder(zstd.SpeedFastest)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "zstd encoder")
	}
	return encodePageMap(enc, m, 0, m.Len())
}

// DecodePageMap reads what EncodePageMap wrote, for a RAM file of size
// bytes: exactly its pages' entries.
func DecodePageMap(data []byte, size int64) (*PageMap, error) {
	if err := CheckSize(size); err != nil {
		return nil, err
	}
	dec, err := newMapDecoder()
	if err != nil {
		return nil, err
	}
	defer dec.Close()
	bad := errcode.New(errcode.InvalidInput, "the page map does not decompress to the entries of a %d-byte RAM file", size)
	if err := dec.Reset(bytes.NewReader(data)); err != nil {
		return nil, bad
	}
	r := bufio.NewReaderSize(dec, 64<<10)
	pages := Pages(size)
	m := newPageMap(pages)
	for i := range pages {
		e, ok := readEntry(r)
		if !ok {
			return nil, bad
		}
		m.addEntry(i, e)
	}
	if _, err := r.ReadByte(); err != io.EOF {
		return nil, bad
	}
	m.finish()
	return m, nil
}

// addEntry enters page i's entry, if it is a data page (after every page
// added before it).
func (m *PageMap) addEntry(i int, e entry) {
	if e.fast != 0 {
		m.add(i, e.fast)
		m.strong[len(m.strong)-1] = e.strong
	}
}

// Package forge plants, for tests, the forged memory-file parent that
// issue 21 (HIGH 2) describes: what someone who may write a VM's tag, and
// read its repository, can build without knowing the VM's memory. It uses
// only the published image format, as such a writer would.
//
// It is for tests only: it writes blobs and a manifest, and nothing checks
// what it plants but the code under test.
package forge

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"math/rand/v2"
	"os"
	"strconv"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// Parent builds, beside the victim's memory-file checkpoint in repo, a
// parent whose page map carries the victim's xxhash64 for every page (read
// from the victim's published map) and, for the victim's data pages below
// span, the SHA-256 of pages of the attacker's own (random, from seed),
// which its packs hold after the victim's. Its map agrees with its
// layers, so a prepare that checks the one against the other passes; a
// checkpoint of the victim that takes it as its parent finds no page
// changed and restores the attacker's pages. It returns the manifest
// (untagged) and the attacker's pages by page number.
func Parent(ctx context.Context, repo ociimage.Repository, victim ocispec.Descriptor, span int64, seed uint64, stagingDir string) (ocispec.Descriptor, map[int][]byte, error) {
	victim, err := ociimage.StateManifest(ctx, repo, victim) // a checkpoint's tag names its index
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	m, err := repo.Manifest(ctx, victim)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	cfgBlob, err := repo.Blob(ctx, m.Config, 1<<20)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	var cfg struct {
		RAM struct {
			Bytes int64 `json:"bytes"`
		} `json:"ram"`
	}
	if err := json.Unmarshal(cfgBlob, &cfg); err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	size := cfg.RAM.Bytes
	var stream, ramLayers []ocispec.Descriptor
	for _, l := range m.Layers {
		if ramfile.IsRAMLayer(l) {
			ramLayers = append(ramLayers, l)
		} else {
			stream = append(stream, l)
		}
	}
	layers, err := ramfile.SplitLayers(ramLayers, size)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	victimMap, err := ramfile.LoadPageMap(ctx, layers, repo, size)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	pages, err := attackerPages(victimMap, span, seed)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	st, ownMap, err := storePages(ctx, repo, layers, victimMap, pages, size, stagingDir)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	mapLayer, err := forgedMap(ctx, repo, victimMap, ownMap, pages)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	m.Layers = append(append(append(append(stream, mapLayer), st.Index), layers.Packs...), st.Packs...)
	if m.Config, err = extendChain(ctx, repo, m.Config, cfgBlob, victim, st); err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	desc, err := repo.PutManifest(ctx, m)
	return desc, pages, err
}

// attackerPages are random pages at the victim's data pages below span.
func attackerPages(victim *ramfile.PageMap, span int64, seed uint64) (map[int][]byte, error) {
	rng := rand.New(rand.NewPCG(seed, seed))
	pages := map[int][]byte{}
	for i := range min(victim.Len(), int(span/ramfile.PageSize)) {
		if victim.IsZero(i) {
			continue
		}
		p := make([]byte, ramfile.PageSize)
		for k := range p {
			p[k] = byte(rng.Uint32())
		}
		pages[i] = p
	}
	return pages, nil
}

// storePages stores pages as a delta on the victim would (its packs, an
// index over the victim's chain whose region hashes are what the layers
// give): it materializes the victim's file, writes the attacker's pages
// over it, and stores the pages that differ. It returns what it stored
// and the map of the file that makes.
func storePages(ctx context.Context, repo ociimage.Repository, victim ramfile.Layers, victimMap *ramfile.PageMap, pages map[int][]byte, size int64, stagingDir string) (ramfile.Stored, *ramfile.PageMap, error) {
	var st ramfile.Stored
	f, err := os.CreateTemp(stagingDir, "forged-*.ram")
	if err != nil {
		return st, nil, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if _, err := ramfile.Materialize(ctx, victim, repo, f, size, ramfile.MaterializeOptions{}); err != nil {
		return st, nil, err
	}
	for i, p := range pages {
		if _, err := f.WriteAt(p, int64(i)*ramfile.PageSize); err != nil {
			return st, nil, err
		}
	}
	index, err := ramfile.LoadIndex(ctx, victim, repo, size)
	if err != nil {
		return st, nil, err
	}
	c, err := ramfile.Scan(f, size, &ramfile.Parent{Map: victimMap}, stagingDir)
	if err != nil {
		return st, nil, err
	}
	defer c.Close()
	st, err = c.Store(ctx, repo, ramfile.StoreOptions{Parent: index})
	return st, c.Map, err
}

// forgedMap is one page map layer: the victim's xxhash64 for every page,
// and the attacker's SHA-256 where the attacker stored a page.
func forgedMap(ctx context.Context, repo ociimage.Repository, victim, own *ramfile.PageMap, pages map[int][]byte) (ocispec.Descriptor, error) {
	var raw bytes.Buffer
	var e [24]byte
	for i := range victim.Len() {
		clear(e[:])
		if !victim.IsZero(i) {
			binary.LittleEndian.PutUint64(e[:8], victim.Fast(i))
			s := victim.Strong(i)
			if _, ok := pages[i]; ok {
				s = own.Strong(i)
			}
			copy(e[8:], s[:])
		}
		raw.Write(e[:])
	}
	enc, err := zstd.NewWriter(nil)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	data := enc.EncodeAll(raw.Bytes(), nil)
	d := ocispec.Descriptor{MediaType: ociimage.MediaTypeRAMPageMap, Digest: digest.FromBytes(data), Size: int64(len(data)),
		Annotations: map[string]string{ociimage.AnnotationRAMFirstPage: "0", ociimage.AnnotationRawSize: strconv.Itoa(raw.Len())}}
	return d, repo.PutBlob(ctx, d, data)
}

// extendChain is the victim's config with one more link, the attacker's
// packs, after the victim's own checkpoint.
func extendChain(ctx context.Context, repo ociimage.Repository, desc ocispec.Descriptor, blob []byte, victim ocispec.Descriptor, st ramfile.Stored) (ocispec.Descriptor, error) {
	var cfg map[string]any
	if err := json.Unmarshal(blob, &cfg); err != nil {
		return desc, err
	}
	ram := cfg["ram"].(map[string]any)
	chain := ram["chain"].([]any)
	chain[len(chain)-1].(map[string]any)["manifest"] = victim.Digest.String()
	ram["chain"] = append(chain, map[string]any{"created": time.Now().UTC(), "regions": st.Frames, "packs": len(st.Packs), "storedBytes": 0, "changedPages": 0})
	out, err := json.Marshal(cfg)
	if err != nil {
		return desc, err
	}
	d := ocispec.Descriptor{MediaType: desc.MediaType, Digest: digest.FromBytes(out), Size: int64(len(out))}
	return d, repo.PutBlob(ctx, d, out)
}

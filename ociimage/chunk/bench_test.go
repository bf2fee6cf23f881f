package chunk

import (
	"bytes"
	"context"
	"io"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
)

// BenchmarkStreamVsSingleThreadZstd measures the chunk pipeline (chunk,
// compress on every core, digest, store) against what a careful script does
// with one zstd thread, on the same data in the same run, and reports the
// ratio. Run with `make bench`.
func BenchmarkStreamVsSingleThreadZstd(b *testing.B) {
	data := chunkdata.Stream(b, 128<<20)
	baseline := func() time.Duration {
		start := time.Now()
		enc, _ := zstd.NewWriter(io.Discard, zstd.WithEncoderConcurrency(1), zstd.WithEncoderLevel(zstd.SpeedDefault))
		_, _ = io.Copy(enc, bytes.NewReader(data))
		_ = enc.Close()
		return time.Since(start)
	}
	var pipeline, single time.Duration
	var stored int64
	for b.Loop() {
		single += baseline()
		start := time.Now()
		res, err := EncodeStream(context.Background(), bytes.NewReader(data), discardSink{}, StreamOptions{})
		if err != nil {
			b.Fatal(err)
		}
		pipeline += time.Since(start)
		stored = res.StoredBytes
	}
	n := float64(b.N)
	b.ReportMetric(float64(len(data))/(pipeline.Seconds()/n)/1e6, "MB/s")
	b.ReportMetric(float64(len(data))/(single.Seconds()/n)/1e6, "baseline-MB/s")
	b.ReportMetric(single.Seconds()/pipeline.Seconds(), "speedup")
	b.ReportMetric(float64(stored)/float64(len(data)), "ratio")
}

// BenchmarkDecodeStream measures verify + decompress + in-order write.
func BenchmarkDecodeStream(b *testing.B) {
	data := chunkdata.Stream(b, 128<<20)
	store := chunkdata.NewStore()
	res, err := EncodeStream(context.Background(), bytes.NewReader(data), store, StreamOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		if _, err := DecodeStream(context.Background(), res.Layers, store, io.Discard, StreamOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}

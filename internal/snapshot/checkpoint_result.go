package snapshot

import (
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/vmstate"
)

// result is what Checkpoint reports: the state image, and the disk and
// rootfs images the run captured.
func (c *checkpointRun) result(res *vmstate.CheckpointResult) *api.CheckpointResult {
	out := &api.CheckpointResult{
		Checkpoint: &api.CheckpointRef{Image: res.CheckpointImage.String(), Digest: res.Checkpoint.Digest.String()},
		VMState: api.VMStateResult{
			Image:         res.Image.String(),
			Digest:        res.Manifest.Digest.String(),
			RawBytes:      res.Stream.RawBytes,
			StoredBytes:   res.Stream.StoredBytes,
			UploadedBytes: res.Stream.UploadedBytes,
			Chunks:        len(res.Stream.Layers),
			QEMUVersion:   res.Config.Record.QEMUVersion,
			Machine:       res.Config.Record.Machine,
			MemoryBytes:   res.Config.Record.MemoryBytes,
			Format:        formatName(res.Config.Format),
			RAM:           ramResult(res),
			DurationsMs: map[string]float64{
				"prepare": api.Ms(res.Durations.Prepare), "stream": api.Ms(res.Durations.Stream),
				"disk": api.Ms(res.Durations.Stopped), "push": api.Ms(res.Durations.Push), "total": api.Ms(res.Durations.Total),
				// mapped-ram: QEMU writing its file; memory-file: scanning the
				// RAM file while the VM is stopped (both part of stream).
				"save": api.Ms(res.Durations.Save),
				// memory-file, snapshot mode: the pre-copy, the VM running
				// until its final pass (precopy is before stream).
				"precopy": api.Ms(res.Durations.Precopy),
			},
		},
		Mode:       c.s.Mode,
		DowntimeMs: api.Ms(res.Downtime),
		VMRunning:  res.VMRunning,
		TotalMs:    api.Ms(res.Durations.Total),
	}
	out.Disk = c.diskResult()
	if layer := c.layer; layer != nil {
		out.Rootfs = &api.RootfsResult{
			Image: layer.Image.String(), Digest: layer.Manifest.Digest.String(), ContainerID: layer.ContainerID,
			BaseImage: layer.BaseImage, Layer: layer.Layer.Digest.String(), LayerBytes: layer.Layer.Size, Compression: layer.Compression,
			StoredBytes: layer.StoredBytes, UploadedBytes: layer.UploadedBytes,
			DurationsMs: map[string]float64{"diff": api.Ms(layer.Durations.Diff), "compress": api.Ms(layer.Durations.Compress), "push": api.Ms(layer.Durations.Push), "total": api.Ms(layer.Durations.Total)},
		}
		if c.diskInRootfs {
			out.Disk.InRootfs = &api.DiskInRootfs{Image: out.Rootfs.Image, Digest: out.Rootfs.Digest, Path: c.s.DiskRootfsPath}
		}
	}
	return out
}

// diskResult is the overlay captured as an image of its own, else the one
// in the rootfs image, else nil.
func (c *checkpointRun) diskResult() *api.DiskResult {
	switch disk := c.disk; {
	case disk != nil:
		return &api.DiskResult{
			Image: disk.Image.String(), Digest: disk.Manifest.Digest.String(), Path: c.s.DiskPath,
			RawBytes: disk.Stream.RawBytes, StoredBytes: disk.Stream.StoredBytes, UploadedBytes: disk.Stream.UploadedBytes,
			Chunks: len(disk.Stream.Layers), VirtualSize: disk.Config.VirtualSize, BackingFile: disk.Config.BackingFile,
			DurationsMs: map[string]float64{"total": api.Ms(disk.Duration)},
		}
	case c.diskInRootfs:
		return &api.DiskResult{
			Path: c.s.DiskPath, RawBytes: c.overlaySz, VirtualSize: c.ovl.VirtualSize, BackingFile: c.ovl.BackingFile,
			DurationsMs: map[string]float64{"total": api.Ms(c.overlayDur)},
		}
	}
	return nil
}

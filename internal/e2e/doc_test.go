package e2e

import (
	"fmt"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/rootfs/overlay"
	"github.com/vmsnap/vmsnap/vmstate"
)

// inspectDoc is what `vmsnap inspect --json` prints, field for field: the
// tests decode it with unknown fields refused, so a field the CLI adds or
// renames fails them. (It mirrors the CLI's own type, which is not
// importable from package main.)
type inspectDoc struct {
	Image        string              `json:"image"`
	Digest       string              `json:"digest"`
	ArtifactType string              `json:"artifactType"`
	Chunks       int                 `json:"chunks"`
	StoredBytes  int64               `json:"storedBytes"`
	Annotations  map[string]string   `json:"annotations,omitempty"`
	VMState      *vmstate.Config     `json:"vmstate,omitempty"`
	Disk         *overlay.DiskConfig `json:"disk,omitempty"`
	Checkpoint   *struct {
		VMState      string            `json:"vmstate"`
		Disk         string            `json:"disk,omitempty"`
		DiskInRootfs *api.DiskInRootfs `json:"diskInRootfs,omitempty"`
		Rootfs       string            `json:"rootfs,omitempty"`
	} `json:"checkpoint,omitempty"`
	LinkedDisk   *inspectDoc `json:"linkedDisk,omitempty"`
	LinkedRootfs *struct {
		Image      string `json:"image"`
		Digest     string `json:"digest"`
		Layers     int    `json:"layers"`
		Bytes      int64  `json:"bytes"`
		BaseImage  string `json:"baseImage,omitempty"`
		Layer      string `json:"layer"`
		LayerBytes int64  `json:"layerBytes"`
	} `json:"linkedRootfs,omitempty"`
	Referrers []struct {
		Image        string            `json:"image"`
		Digest       string            `json:"digest"`
		ArtifactType string            `json:"artifactType"`
		Annotations  map[string]string `json:"annotations,omitempty"`
	} `json:"referrers,omitempty"`
}

// humanBytes formats n as the CLI's progress lines do (1.5 MiB), for the
// tests' own logs.
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

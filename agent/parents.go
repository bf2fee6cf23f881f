package agent

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"

	"github.com/vmsnap/vmsnap/vmstate"
)

// parentRecordsDir is where the agent records a VM's last memory-file
// checkpoint, the parent of its next (vmstate.ParentRecords): a directory
// of its state directory per pod UID and container, named by a hash of
// the two (nothing a caller sent becomes a path).
func (s *Server) parentRecordsDir(podUID, container string) string {
	sum := sha256.Sum256([]byte(podUID + "\x00" + container))
	return filepath.Join(s.cfg.StateDir, "parents", hex.EncodeToString(sum[:16]))
}

// parentRecords are the records of the VM t: one per VM, usable only by a
// checkpoint of that pod's container in that namespace (Scope).
func (s *Server) parentRecords(t Target) *vmstate.ParentRecords {
	return &vmstate.ParentRecords{Dir: s.parentRecordsDir(t.PodUID, t.Container), Key: "vm",
		Scope: t.Namespace + "/" + t.PodUID + "/" + t.Container}
}

// forgetParent removes the record of a VM whose container is gone: a new
// container under the same name is another VM.
func (s *Server) forgetParent(g Gone) error {
	return os.RemoveAll(s.parentRecordsDir(g.PodUID, g.Container))
}

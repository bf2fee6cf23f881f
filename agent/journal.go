package agent

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
)

// journal keeps one file per unfinished operation under STATE/ops, written
// (and synced) before the VM is touched, so that a restarted agent knows
// which VMs it may have left stopped.
type journal struct{ dir string }

type journalEntry struct {
	Op api.Operation `json:"op"`
	// VMWasRunning: the VM ran when the checkpoint started, so whoever
	// finds this entry must make sure it runs again.
	VMWasRunning bool `json:"vmWasRunning"`
}

func openJournal(stateDir string) (*journal, error) {
	dir := filepath.Join(stateDir, "ops")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the journal in %s", stateDir)
	}
	// Leftover temp files are from writes a crash interrupted.
	// (*.tmp: the names used before internal/atomicfile.)
	tmps, _ := filepath.Glob(filepath.Join(dir, "*.tmp"))
	atomicTmps, _ := filepath.Glob(filepath.Join(dir, ".*"+atomicfile.TempInfix+"*"))
	for _, t := range append(tmps, atomicTmps...) {
		_ = os.Remove(t)
	}
	return &journal{dir: dir}, nil
}

func (j *journal) path(id string) string { return filepath.Join(j.dir, id+".json") }

func (j *journal) write(e journalEntry) error {
	b, err := json.Marshal(e)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "encoding the journal entry")
	}
	if err := atomicfile.WriteFile(j.path(e.Op.ID), b, 0o600); err != nil {
		return errcode.Wrap(errcode.Internal, err, "writing the journal")
	}
	return nil
}

func (j *journal) remove(id string) error {
	if err := os.Remove(j.path(id)); err != nil && !os.IsNotExist(err) {
		return err
	}
	return atomicfile.SyncDir(j.dir)
}

// list returns the entries of unfinished operations.
func (j *journal) list() ([]journalEntry, error) {
	names, err := filepath.Glob(filepath.Join(j.dir, "*.json"))
	if err != nil {
		return nil, err
	}
	var out []journalEntry
	for _, n := range names {
		e, ok, err := j.read(strings.TrimSuffix(filepath.Base(n), ".json"))
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, e)
		}
	}
	return out, nil
}

// read returns the entry of operation id, if it has a readable one.
func (j *journal) read(id string) (journalEntry, bool, error) {
	b, err := os.ReadFile(j.path(id))
	if os.IsNotExist(err) {
		return journalEntry{}, false, nil
	}
	if err != nil {
		return journalEntry{}, false, err
	}
	var e journalEntry
	if err := json.Unmarshal(b, &e); err != nil || e.Op.ID != id {
		// An entry we cannot read names no VM we could help.
		_ = os.Remove(j.path(id))
		return journalEntry{}, false, nil
	}
	if e.Op.Namespace == "" {
		// Written by an agent that kept a VM's namespace in its Target only.
		e.Op.Namespace = targetNamespace(e.Op.Target)
	}
	return e, true, nil
}

// continueVM makes a VM run again after a checkpoint that did not finish:
// it cancels a migration still under way and continues a stopped VM.
// qmpSock is the VM's QMP socket (an O_PATH descriptor) and name its path
// inside the container.
func continueVM(ctx context.Context, qmpSock *os.File, name string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	mon, err := qmp.DialFile(ctx, qmpSock, name)
	if err != nil {
		return err
	}
	defer mon.Close()
	var mig struct{ Status string }
	if err := mon.Execute(ctx, "query-migrate", nil, &mig); err == nil {
		switch mig.Status {
		case "setup", "active", "device", "pre-switchover":
			_ = mon.Execute(ctx, "migrate_cancel", nil, nil)
			for i := 0; i < 100; i++ {
				if mon.Execute(ctx, "query-migrate", nil, &mig) != nil || (mig.Status != "cancelling" && mig.Status != "active") {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	st, err := mon.Status(ctx)
	if err != nil {
		return err
	}
	switch st.Status {
	case "running", "inmigrate":
		return nil
	}
	return mon.Execute(ctx, "cont", nil, nil)
}

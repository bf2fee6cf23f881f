package agent

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
)

// A journal write is whole and private (0600, it names pods and paths),
// leaves no temporary file, and a restarted agent sweeps the temporary
// files a crash left, of either naming, without touching the entries.
func TestJournalWriteAndLeftovers(t *testing.T) {
	state := t.TempDir()
	j, err := openJournal(state)
	if err != nil {
		t.Fatal(err)
	}
	e := journalEntry{Op: api.Operation{ID: "op1", Kind: api.KindCheckpoint}, VMWasRunning: true}
	if err := j.write(e); err != nil {
		t.Fatalf("write: %v", err)
	}
	if fi, err := os.Stat(j.path("op1")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("journal entry: %v, mode %v; want 0600", err, fi)
	}
	names := func() []string {
		ents, err := os.ReadDir(j.dir)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, d := range ents {
			out = append(out, d.Name())
		}
		return out
	}
	if got := names(); !slices.Equal(got, []string{"op1.json"}) {
		t.Fatalf("journal directory holds %v, want only op1.json", got)
	}
	for _, leftover := range []string{"op2.json.tmp", ".op3.json.vmsnap-tmp-0123456789abcdef"} {
		if err := os.WriteFile(filepath.Join(j.dir, leftover), []byte("{"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if j, err = openJournal(state); err != nil {
		t.Fatal(err)
	}
	if got := names(); !slices.Equal(got, []string{"op1.json"}) {
		t.Fatalf("after a restart the journal directory holds %v, want only op1.json", got)
	}
	entries, err := j.list()
	if err != nil || len(entries) != 1 || entries[0].Op.ID != "op1" || !entries[0].VMWasRunning {
		t.Fatalf("list = %+v, %v; want the one entry written", entries, err)
	}
}

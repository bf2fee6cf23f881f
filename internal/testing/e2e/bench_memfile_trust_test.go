//go:build linux

package e2e

import (
	"fmt"
	"strings"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// trustCost is what trusting a parent only as far as a checkpoint verified
// it costs ("Trust in the parent" in docs/memory-file.md): pairs of deltas of the same
// running guest, back to back, one on the parent the node recorded (its
// map taken as is), one on the same kind of parent named with --parent
// and no record (every page it vouches for hashed with SHA-256 and
// compared); each pair's ratio, verified over recorded.
type trustCost struct {
	// snapshot mode: the guest's downtime, and vmsnap's CPU time
	snapDown, snapCPU []float64
	// pause mode: the scan of the stopped guest's RAM file (durationsMs.save),
	// and vmsnap's CPU time
	scan, scanCPU []float64
	// the figures of the last pair, for the log
	last string
}

// benchPairs is how many pairs trustCost takes per mode.
func (bb *bench) benchPairs() int { return max(3, bb.runs) }

// parentTrustCost measures trustCost on g's running guest, whose last
// checkpoint records holds.
func (bb *bench) parentTrustCost(g *mfGuest, records string) *trustCost {
	b := bb.b
	src := g.vm
	repo := bb.repo(fmt.Sprintf("mf-trust-%d", g.memMB))
	c := &trustCost{}
	seq := 0
	ckpt := func(mode string, extra ...string) (api.CheckpointResult, timed) {
		seq++
		bb.settled(src)
		var cp api.CheckpointResult
		// Every pair adds a delta to the chain: room for them all.
		args := append([]string{"checkpoint", "--qmp", src.QMPPath(), "--image", fmt.Sprintf("%s:t%d", repo, seq), "--format", "memory-file", "--mode", mode,
			"--max-chain", "64"}, extra...)
		tm := bb.runCLI(src, &cp, args...)
		if mode == string(vmspec.ModePause) {
			qmpOnce(b, src.QMPPath(), "cont", nil)
		}
		return cp, tm
	}
	var parent string
	for i := range 2 * bb.benchPairs() {
		mode := string(vmspec.ModeSnapshot)
		if i >= bb.benchPairs() {
			mode = string(vmspec.ModePause)
		}
		recorded := func() (api.CheckpointResult, timed) {
			cp, tm := ckpt(mode, "--parent-records", records)
			parent = cp.VMState.Image
			return cp, tm
		}
		verified := func() (api.CheckpointResult, timed) {
			// A directory of its own: no record, and it keeps none for the next.
			return ckpt(mode, "--parent-records", b.TempDir(), "--parent", parent)
		}
		if parent == "" {
			recorded()
		}
		var rc, vc api.CheckpointResult
		var rt, vt timed
		if i%2 == 0 {
			rc, rt = recorded()
			vc, vt = verified()
		} else {
			vc, vt = verified()
			rc, rt = recorded()
		}
		for name, cp := range map[string]api.CheckpointResult{vmstate.ParentRecorded: rc, vmstate.ParentVerified: vc} {
			if r := cp.VMState.RAM; r == nil || r.ParentTrust != name || r.RefutedPages != 0 {
				b.Fatalf("the %s delta: %+v", name, r)
			}
		}
		if mode == string(vmspec.ModeSnapshot) {
			c.snapDown = append(c.snapDown, vc.DowntimeMs/rc.DowntimeMs)
			c.snapCPU = append(c.snapCPU, vt.cpu.client/rt.cpu.client)
		} else {
			c.scan = append(c.scan, vc.VMState.DurationsMs["save"]/rc.VMState.DurationsMs["save"])
			c.scanCPU = append(c.scanCPU, vt.cpu.client/rt.cpu.client)
		}
		c.last = fmt.Sprintf("%s: verified downtime %.0f ms, scan %.0f ms, vmsnap CPU %.2f s; recorded %.0f ms, %.0f ms, %.2f s",
			mode, vc.DowntimeMs, vc.VMState.DurationsMs["save"], vt.cpu.client, rc.DowntimeMs, rc.VMState.DurationsMs["save"], rt.cpu.client)
		b.Logf("bench: %d MiB parent trust, pair %d, %s", g.memMB, i, c.last)
	}
	return c
}

// trustRows are the report's rows of trustCost, as rowf takes them.
func trustRows(rowf func(name string, f func(s *mfSize) string, target string, verdict func(s *mfSize) bool)) {
	ratio := func(v []float64) string {
		var s []string
		for _, x := range v {
			s = append(s, fmt.Sprintf("%.2f", x))
		}
		return fmt.Sprintf("%.2fx (%s)", medianF(v), strings.Join(s, " "))
	}
	rowf("parent verified / recorded: snapshot downtime", func(s *mfSize) string { return ratio(s.trust.snapDown) }, "", nil)
	rowf("  the same, vmsnap CPU", func(s *mfSize) string { return ratio(s.trust.snapCPU) }, "", nil)
	rowf("  pause mode: the scan (guest stopped)", func(s *mfSize) string { return ratio(s.trust.scan) }, "", nil)
	rowf("  the same, vmsnap CPU", func(s *mfSize) string { return ratio(s.trust.scanCPU) }, "", nil)
}

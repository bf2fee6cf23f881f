package e2e

// One tenant floods the agent binary with event stream requests from a
// pod: real containerd places each connection's caller as the agent
// accepts it.

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/streamflood"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// e2eFloodRSSBound is what docs/security-model.md promises the flood below can add to
// the agent's peak RSS, another tenant's small checkpoint included.
const e2eFloodRSSBound = 32 << 20

// tenant-a's pod makes 20,000 event stream requests, 64 at a time, keeping
// every stream it gets. It gets its limit and BUSY for the rest; tenant-b's
// checkpoint through the agent completes meanwhile; the agent's peak RSS
// grows by less than e2eFloodRSSBound.
func TestAgentE2EStreamFloodFromOneTenant(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	vmsnapBin, flood := binary(t), buildTestProgram(t, "streamflood")
	vm := qmptest.NewFakeQEMU(t, "running", bytes.Repeat([]byte("tenant-b's memory "), 1<<15))
	uidB := containerd.NewPodUID()
	ctrd.Create(t, containerd.PodContainer{PodUID: uidB, PodNamespace: "tenant-b", Name: "qemu", HostDir: filepath.Dir(vm.Path())})
	layouts := tempRoot(t)
	sockDir := guest.FreeShortDir(t)
	sock := filepath.Join(sockDir, "agent.sock")
	p := startAgentProc(t, ctrd, t.TempDir(), sock, "--layout-root", layouts)
	pid := p.cmd.Process.Pid
	if err := os.WriteFile("/proc/"+strconv.Itoa(pid)+"/clear_refs", []byte("5"), 0); err != nil {
		t.Fatalf("resetting the agent's peak RSS: %v", err)
	}
	base := procStatusKiB(t, pid, "VmRSS") << 10

	floodDone := make(chan []byte, 1)
	go func() {
		_, out := inPod(t, ctrd, "tenant-a", sockDir, flood, "/run/vmsnap/agent.sock", "20000", "64")
		floodDone <- out
	}()
	// tenant-b checkpoints once the flood is refused.
	deadline := time.Now().Add(time.Minute)
	for metricSum(t, sock, "vmsnap_caller_limit_refusals_total{") == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the flood was never refused")
		}
		time.Sleep(20 * time.Millisecond)
	}
	code, out := inPod(t, ctrd, "tenant-b", sockDir, vmsnapBin, "checkpoint", "--agent", "unix:///run/vmsnap/agent.sock",
		"--pod-uid", uidB, "--container", "qemu", "--qmp", containerd.DefaultMountPath+"/"+filepath.Base(vm.Path()),
		"--image", "oci:"+layouts+"/tenant-b/vm:1", "--mode", "snapshot", "--workers", "1", "--chunk-size", "65536", "--json")
	if code != 0 {
		t.Fatalf("tenant-b's checkpoint during the flood: exit %d: %s", code, out)
	}
	var r streamflood.Result
	if err := json.Unmarshal(<-floodDone, &r); err != nil {
		t.Fatal(err)
	}
	peak := procStatusKiB(t, pid, "VmHWM") << 10
	t.Logf("tenant-a's flood: %+v; agent RSS %.1f MiB before, peak %.1f MiB (bound: +%d MiB)", r, float64(base)/(1<<20), float64(peak)/(1<<20), e2eFloodRSSBound>>20)
	if r.Streams != agent.DefaultMaxStreamsPerCaller || r.Busy == 0 || len(r.Other) != 0 || r.Total() != 20000 {
		t.Errorf("tenant-a got %+v; want exactly %d streams, the rest refused", r, agent.DefaultMaxStreamsPerCaller)
	}
	if peak-base > e2eFloodRSSBound {
		t.Errorf("the agent's peak RSS grew by %d MiB, over %d MiB", (peak-base)>>20, e2eFloodRSSBound>>20)
	}
}

package e2e

// What a hostile QEMU in a pod can make the agent spend, against the real
// agent binary: a real containerd runs a container labelled as the kubelet
// labels it, whose volume holds a misbehaving peer's QMP socket.

import (
	"bufio"
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// hostilePod runs a container of a new pod whose volume is the hostile
// peer's directory, and returns the VM reference a Job would send.
func hostilePod(t *testing.T, ctrd *containerd.Daemon, h *qmptest.Hostile) api.VMRef {
	t.Helper()
	uid := containerd.NewPodUID()
	ctrd.Create(t, containerd.PodContainer{PodUID: uid, Name: "qemu", HostDir: filepath.Dir(h.Path())})
	return api.VMRef{PodUID: uid, Container: "qemu", QMPPath: containerd.DefaultMountPath + "/" + filepath.Base(h.Path())}
}

// procStatusKiB reads a field of /proc/PID/status, in KiB.
func procStatusKiB(t *testing.T, pid int, field string) int64 {
	t.Helper()
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatalf("%s: %q", field, v)
			}
			return n
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}

// inFlight sums vmsnap_operations_in_flight over its series, from the
// agent's /metrics.
func inFlight(t *testing.T, socket string) float64 {
	t.Helper()
	return metricSum(t, socket, "vmsnap_operations_in_flight{")
}

// metricSum is the sum of the agent's metric series whose line starts
// with prefix (a name and "{").
func metricSum(t *testing.T, socket, prefix string) float64 {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", socket)
	}}, Timeout: 5 * time.Second}
	resp, err := hc.Get("http://agent/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sum, seen := 0.0, false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, prefix) {
			v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
			if err != nil {
				t.Fatalf("metrics line %q", l)
			}
			sum, seen = sum+v, true
		}
	}
	if !seen && strings.HasPrefix(prefix, "vmsnap_operations_in_flight") {
		t.Fatal("/metrics has no vmsnap_operations_in_flight series")
	}
	return sum
}

// TestAgentE2EHostileQEMU: the agent binary, with a 3s --operation-timeout,
// against three peers on QMP sockets in pods' volumes:
//   - one that answers with a 512 MiB line: QMP_ERROR, the agent's peak RSS
//     stays under 300 MiB, and it still answers /healthz;
//   - one that greets and never answers: the operation fails by its
//     deadline with QMP_ERROR, and nothing is left in flight;
//   - one that never greets (as QEMU does while another client holds its
//     monitor): the operation fails by its deadline, BUSY, saying why.
func TestAgentE2EHostileQEMU(t *testing.T) {
	ctrd := containerd.Start(t)
	huge := qmptest.NewHostile(t, qmptest.HugeLine)
	silent := qmptest.NewHostile(t, qmptest.GreetsThenSilent)
	mute := qmptest.NewHostile(t, qmptest.NeverGreets)
	hugeVM, silentVM, muteVM := hostilePod(t, ctrd, huge), hostilePod(t, ctrd, silent), hostilePod(t, ctrd, mute)
	sock := filepath.Join(guest.FreeShortDir(t), "agent.sock")
	const timeout = 3 * time.Second
	p := startAgentProc(t, ctrd, t.TempDir(), sock, "--operation-timeout", timeout.String(), "--layout-root", tempRoot(t))
	c, err := agent.NewClient("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	image := "oci:" + filepath.Join(t.TempDir(), "store") + ":vm"
	run := func(vm api.VMRef) (api.Operation, time.Duration) {
		t.Helper()
		start := time.Now()
		op, err := c.Checkpoint(ctx, api.CheckpointRequest{VM: vm, Image: image, Mode: "snapshot"})
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		final, err := c.Wait(wctx, op.ID, nil)
		if err != nil {
			t.Fatal(err)
		}
		return final, time.Since(start)
	}

	pid := p.cmd.Process.Pid
	before := procStatusKiB(t, pid, "VmHWM")
	final, d := run(hugeVM)
	peak := procStatusKiB(t, pid, "VmHWM")
	t.Logf("512 MiB line: %s after %v (%v); the peer wrote %d MiB; agent peak RSS %d MiB before, %d MiB after",
		final.State, d.Round(time.Millisecond), final.Error, huge.HugeLineWritten()>>20, before>>10, peak>>10)
	if final.State != api.StateFailed || final.Error.Code != errcode.QMPError || !strings.Contains(final.Error.Message, "longer than 16 MiB") {
		t.Fatalf("checkpoint of a QEMU sending a 512 MiB line: %s %+v, want failed with QMP_ERROR", final.State, final.Error)
	}
	if w := huge.HugeLineWritten(); w <= 16<<20 || w >= qmptest.HugeLineBytes {
		t.Fatalf("the peer wrote %d MiB of its line: want more than the cap (or the test proves nothing) and not all of it", w>>20)
	}
	if peak >= 300<<10 {
		t.Fatalf("the agent's peak RSS reached %d MiB, want under 300 MiB", peak>>10)
	}
	if err := c.Health(ctx); err != nil {
		t.Fatalf("/healthz after the 512 MiB line: %v", err)
	}

	final, d = run(silentVM)
	if final.State != api.StateFailed || final.Error.Code != errcode.QMPError || !strings.Contains(final.Error.Message, "--operation-timeout of 3s") {
		t.Fatalf("checkpoint of a QEMU that never answers: %s %+v, want failed with QMP_ERROR naming the timeout", final.State, final.Error)
	}
	// Ended by the timeout (the message names it), and not before it.
	if d < timeout {
		t.Fatalf("the silent QEMU's operation ended after %v, before its timeout of %v", d, timeout)
	}
	if n := inFlight(t, sock); n != 0 {
		t.Fatalf("vmsnap_operations_in_flight sums to %v after the timeout", n)
	}

	final, _ = run(muteVM)
	if final.State != api.StateFailed || final.Error.Code != errcode.Busy || !strings.Contains(final.Error.Message, "another client probably holds the monitor") {
		t.Fatalf("checkpoint of a QEMU that never greets: %s %+v", final.State, final.Error)
	}
	if n := inFlight(t, sock); n != 0 {
		t.Fatalf("vmsnap_operations_in_flight sums to %v", n)
	}
}

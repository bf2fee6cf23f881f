package guest

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

var uuidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// testCtx bounds a real-QEMU test well inside go test's default 10m timeout.
func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func checkHealthy(t *testing.T, st Status) {
	t.Helper()
	if !uuidRE.MatchString(st.Boot) {
		t.Errorf("boot id %q is not a UUID", st.Boot)
	}
	if st.Mem != st.Mem0 {
		t.Errorf("mem=%s differs from mem0=%s", st.Mem, st.Mem0)
	}
	if !strings.HasPrefix(st.Disk, MarkerPrefix) || !uuidRE.MatchString(strings.TrimPrefix(st.Disk, MarkerPrefix)) {
		t.Errorf("disk=%q is not a marker %s<uuid>", st.Disk, MarkerPrefix)
	}
}

func TestGuestBoots(t *testing.T) {
	ctx := testCtx(t, 4*time.Minute)
	dir := FreeShortDir(t)
	vm := Start(t, Options{Disk: NewDisk(t, dir), Dir: dir})

	ready, err := vm.WaitReady(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("boot to VMSNAP ready: %s (%s)", time.Since(vm.Started()).Round(time.Millisecond), ready.Line)

	s1, err := vm.WaitStatus(ctx, func(Status) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	t1 := time.Now()
	s2, err := vm.WaitStatus(ctx, func(s Status) bool { return s.Counter > s1.Counter })
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("one status line: %s", time.Since(t1).Round(time.Millisecond))
	t.Logf("status: %s", s2)

	if s1.Counter != 1 || s2.Counter != 2 {
		t.Errorf("counters %d, %d; want 1, 2", s1.Counter, s2.Counter)
	}
	for _, st := range []Status{s1, s2} {
		checkHealthy(t, st)
		if st.Boot != ready.Boot || st.Mem0 != ready.Mem0 {
			t.Errorf("status %s disagrees with the ready line %s", st, ready.Line)
		}
		if want := MarkerPrefix + st.Boot; st.Disk != want {
			t.Errorf("disk=%q; want the marker of this boot %q", st.Disk, want)
		}
	}
	if last, ok := vm.LastStatus(); !ok || last.Counter < s2.Counter {
		t.Errorf("LastStatus = %v, %v; want counter >= %d", last, ok, s2.Counter)
	}
	if n := vm.ReadyCount(); n != 1 {
		t.Errorf("%d VMSNAP ready lines; want 1", n)
	}
	if vm.Exited() {
		t.Errorf("QEMU exited: %v", vm.ExitErr())
	}

	// disk= is read from the device, not from the guest's page cache: a
	// write made behind the guest's back (QEMU's qemu-io) shows up.
	if _, err := vm.QMP(ctx, "human-monitor-command",
		map[string]any{"command-line": `qemu-io virtio0 "write -P 0x41 0 512"`}); err != nil {
		t.Fatal(err)
	}
	last, _ := vm.LastStatus()
	st, err := vm.WaitStatus(ctx, func(s Status) bool { return s.Counter > last.Counter+1 })
	if err != nil {
		t.Fatal(err)
	}
	if want := strings.Repeat("A", 100); st.Disk != want {
		t.Errorf("after overwriting sector 0 with 'A's the guest reads disk=%q; want %q", st.Disk, want)
	}
}

func TestGuestNoDisk(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a guest")
	}
	ctx := testCtx(t, 4*time.Minute)
	vm := Start(t, Options{GuestMemMB: 4})
	st, err := vm.WaitStatus(ctx, func(Status) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	if st.Disk != "none" || st.Mem != st.Mem0 {
		t.Errorf("status %s; want disk=none and mem == mem0", st)
	}
}

// A second boot off the same disk keeps the first boot's marker.
func TestGuestMarkerPersists(t *testing.T) {
	if testing.Short() {
		t.Skip("boots two guests")
	}
	ctx := testCtx(t, 6*time.Minute)
	dir := FreeShortDir(t)
	disk := NewDisk(t, dir)

	first := Start(t, Options{Disk: disk, Dir: dir})
	r1, err := first.WaitReady(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := first.QMP(ctx, "quit", nil); err != nil {
		t.Fatal(err)
	}
	if err := first.Wait(ctx); err != nil {
		t.Fatalf("first guest's QEMU: %v", err)
	}

	second := Start(t, Options{Disk: disk, Dir: dir})
	st, err := second.WaitStatus(ctx, func(Status) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	if st.Boot == r1.Boot {
		t.Errorf("second boot has the first one's boot id %s", st.Boot)
	}
	if want := MarkerPrefix + r1.Boot; st.Disk != want {
		t.Errorf("second boot sees disk=%q; want the first boot's marker %q", st.Disk, want)
	}

	// vmsnap.marker=new overwrites it.
	if _, err := second.QMP(ctx, "quit", nil); err != nil {
		t.Fatal(err)
	}
	second.Wait(ctx)
	third := Start(t, Options{Disk: disk, Dir: dir, KernelArgs: []string{"vmsnap.marker=new"}})
	st, err = third.WaitStatus(ctx, func(Status) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	if want := MarkerPrefix + st.Boot; st.Disk != want {
		t.Errorf("with vmsnap.marker=new disk=%q; want %q", st.Disk, want)
	}
}

// The harness's promise: a guest's migration stream, taken as vmsnap takes
// it, loads into a VM started with the same Options plus Incoming, and the
// guest carries on there.
func TestGuestMigrates(t *testing.T) {
	if testing.Short() {
		t.Skip("boots and migrates a guest")
	}
	ctx := testCtx(t, 6*time.Minute)
	dir := FreeShortDir(t)
	opts := Options{Disk: NewDisk(t, dir), Dir: dir}
	src := Start(t, opts)
	before, err := src.WaitStatus(ctx, func(s Status) bool { return s.Counter >= 2 })
	if err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(dir, "state")
	mustQMP := func(vm *VM, cmd string, args any) json.RawMessage {
		t.Helper()
		ret, err := vm.QMP(ctx, cmd, args)
		if err != nil {
			t.Fatalf("%s: %v", vm.Name(), err)
		}
		return ret
	}
	waitMigration := func(vm *VM) {
		t.Helper()
		for {
			var info struct {
				Status    string `json:"status"`
				ErrorDesc string `json:"error-desc"`
			}
			if err := json.Unmarshal(mustQMP(vm, "query-migrate", nil), &info); err != nil {
				t.Fatal(err)
			}
			switch info.Status {
			case "completed":
				return
			case "failed", "cancelled":
				t.Fatalf("%s: migration %s: %s", vm.Name(), info.Status, info.ErrorDesc)
			}
			select {
			case <-ctx.Done():
				t.Fatalf("%s: migration still %q: %v", vm.Name(), info.Status, ctx.Err())
			case <-time.After(100 * time.Millisecond):
			}
		}
	}

	t0 := time.Now()
	mustQMP(src, "stop", nil)
	mustQMP(src, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40})
	mustQMP(src, "migrate", map[string]any{"uri": "exec:cat > " + state})
	waitMigration(src)
	saved := time.Since(t0)
	stopped, _ := src.LastStatus()
	wantCounter := src.ResumeCounter()
	src.Kill()

	opts.Incoming = true
	dst := Start(t, opts)
	t1 := time.Now()
	mustQMP(dst, "migrate-incoming", map[string]any{"uri": "exec:cat " + state})
	waitMigration(dst)
	var status struct {
		Status string `json:"status"`
	}
	json.Unmarshal(mustQMP(dst, "query-status", nil), &status)
	if status.Status != "paused" {
		t.Errorf("target status after migrate-incoming %q; want paused", status.Status)
	}
	mustQMP(dst, "cont", nil)
	t.Logf("saved in %s, loaded in %s", saved.Round(time.Millisecond), time.Since(t1).Round(time.Millisecond))

	after, err := dst.WaitStatus(ctx, func(Status) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("source stopped at %s; target resumed with %s", stopped, after)
	if after.Boot != before.Boot {
		t.Errorf("target boot %s; want the source's %s", after.Boot, before.Boot)
	}
	if after.Counter != wantCounter {
		t.Errorf("target counter %d; want %d (the source stopped after %d, in the middle of %q)",
			after.Counter, wantCounter, stopped.Counter, src.PartialLine())
	}
	checkHealthy(t, after)
	if after.Mem0 != before.Mem0 || after.Disk != before.Disk {
		t.Errorf("target %s; want mem0 and disk of the source %s", after, before)
	}
	if n := dst.ReadyCount(); n != 0 {
		t.Errorf("target printed VMSNAP ready %d times: it booted instead of resuming", n)
	}
}

func TestParseStatus(t *testing.T) {
	const boot = "538b1a36-54c3-4ce9-bef4-3614f5cb7fd6"
	good := fmt.Sprintf("VMSNAP counter=12 boot=%s mem=aa mem0=bb disk=%s%s\r", boot, MarkerPrefix, boot)
	st, ok := ParseStatus(good)
	if !ok || st.Counter != 12 || st.Boot != boot || st.Mem != "aa" || st.Mem0 != "bb" || st.Disk != MarkerPrefix+boot {
		t.Errorf("ParseStatus(%q) = %+v, %v", good, st, ok)
	}
	if st, ok := ParseStatus("[   12.3] virtio_blk: x VMSNAP counter=3 boot=b mem=m mem0=m disk=none"); !ok || st.Counter != 3 || st.Disk != "none" {
		t.Errorf("with a prefix: %+v, %v", st, ok)
	}
	if st, ok := ParseStatus("VMSNAP counter=3 boot=b mem=m mem0=m disk=none rand=00ff"); !ok || st.Rand != "00ff" || st.Disk != "none" {
		t.Errorf("with rand=: %+v, %v", st, ok)
	}
	if st, ok := ParseStatus("VMSNAP counter=3 boot=b mem=m mem0=m rand=00ff"); ok {
		t.Errorf("rand= does not stand in for disk=: %+v", st)
	}
	for _, bad := range []string{
		"",
		"VMSNAP ready boot=b mem0=m disk=none",
		"VMSNAP counter=x boot=b mem=m mem0=m disk=none",
		"VMSNAP counter=3 boot=b mem=m mem0=m",      // truncated
		"VMSNAP counter=3 boot=b mem=m mem0=m disk", // truncated
	} {
		if st, ok := ParseStatus(bad); ok {
			t.Errorf("ParseStatus(%q) = %+v, true", bad, st)
		}
	}
	r, ok := parseReady("VMSNAP ready boot=b mem0=m disk=none mem_mb=16 mem_every=1 uptime=3.46")
	if !ok || r.Boot != "b" || r.Mem != "m" || r.Mem0 != "m" || r.Disk != "none" || r.Counter != 0 {
		t.Errorf("parseReady = %+v, %v", r, ok)
	}
}

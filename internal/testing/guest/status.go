package guest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
)

// Status is one "VMSNAP counter=..." line of the guest's serial console.
type Status struct {
	Counter int    // 1 for the first line after boot, +1 a line
	Boot    string // the guest kernel's boot id (a UUID)
	Mem     string // md5 of the in-memory data, now
	Mem0    string // md5 of the in-memory data when it was written at boot
	Disk    string // /dev/vda's first sector read with O_DIRECT: the marker, "none" without a disk, "empty", or "ioerror"
	Rand    string // 32 bytes read from /dev/urandom just before the line, in hex ("" from a guest built before it printed them)
	Line    string // the line as printed
}

// MarkerPrefix starts the marker the guest writes to its disk:
// MarkerPrefix + boot id.
const MarkerPrefix = "vmsnap-marker-"

// String is the status in the guest's own format.
func (s Status) String() string {
	return fmt.Sprintf("counter=%d boot=%s mem=%s mem0=%s disk=%s", s.Counter, s.Boot, s.Mem, s.Mem0, s.Disk)
}

// ParseStatus parses a line "VMSNAP counter=N boot=B mem=M mem0=M0 disk=D"
// (anything before "VMSNAP " is ignored: a kernel message may share the line).
func ParseStatus(line string) (Status, bool) {
	line = strings.TrimRight(line, "\r\n")
	i := strings.Index(line, "VMSNAP counter=")
	if i < 0 {
		return Status{}, false
	}
	st := Status{Line: line[i:]}
	var have int
	for _, f := range strings.Fields(line[i+len("VMSNAP "):]) {
		k, v, ok := strings.Cut(f, "=")
		if !ok || v == "" {
			return Status{}, false
		}
		switch k {
		case "counter":
			n, err := strconv.Atoi(v)
			if err != nil {
				return Status{}, false
			}
			st.Counter = n
		case "boot":
			st.Boot = v
		case "mem":
			st.Mem = v
		case "mem0":
			st.Mem0 = v
		case "disk":
			st.Disk = v
		case "rand":
			st.Rand = v
			continue // optional: not counted in have
		default:
			continue
		}
		have++
	}
	if have != 5 {
		return Status{}, false
	}
	return st, true
}

// parseReady parses "VMSNAP ready boot=B mem0=M0 disk=D ..." into a Status
// with Counter 0 and Mem = Mem0.
func parseReady(line string) (Status, bool) {
	line = strings.TrimRight(line, "\r\n")
	i := strings.Index(line, "VMSNAP ready ")
	if i < 0 {
		return Status{}, false
	}
	st := Status{Line: line[i:]}
	for _, f := range strings.Fields(line[i+len("VMSNAP ready "):]) {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "boot":
			st.Boot = v
		case "mem0":
			st.Mem0, st.Mem = v, v
		case "disk":
			st.Disk = v
		}
	}
	if st.Boot == "" || st.Mem0 == "" || st.Disk == "" {
		return Status{}, false
	}
	return st, true
}

// poll reads what the serial log gained since the last call and parses its
// complete lines.
func (vm *VM) poll() error {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	f, err := os.Open(vm.serialPath)
	if os.IsNotExist(err) {
		return nil // QEMU has not created it yet
	}
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Seek(vm.parsedOff, io.SeekStart); err != nil {
		return err
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	end := bytes.LastIndexByte(b, '\n')
	if end < 0 {
		return nil
	}
	for _, line := range strings.Split(string(b[:end]), "\n") {
		if st, ok := ParseStatus(line); ok {
			vm.statuses = append(vm.statuses, st)
		} else if st, ok := parseReady(line); ok {
			vm.readyCount++
			if vm.ready == nil {
				vm.ready = &st
			}
		}
	}
	vm.parsedOff += int64(end + 1)
	return nil
}

// Statuses are all status lines the guest has printed so far, in order.
func (vm *VM) Statuses() []Status {
	_ = vm.poll()
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return append([]Status(nil), vm.statuses...)
}

// LastStatus is the latest status line, if any.
func (vm *VM) LastStatus() (Status, bool) {
	_ = vm.poll()
	vm.mu.Lock()
	defer vm.mu.Unlock()
	if len(vm.statuses) == 0 {
		return Status{}, false
	}
	return vm.statuses[len(vm.statuses)-1], true
}

// WaitStatus waits for a status line for which match returns true, trying
// every line printed so far (oldest first) and then each new one, and returns
// it. It fails when ctx ends or QEMU exits first. To wait for a line printed
// from now on, match on a counter above LastStatus's.
func (vm *VM) WaitStatus(ctx context.Context, match func(Status) bool) (Status, error) {
	next, exitSeen := 0, false
	for {
		if err := vm.poll(); err != nil {
			return Status{}, fmt.Errorf("reading the serial log: %w", err)
		}
		vm.mu.Lock()
		news := vm.statuses[next:]
		next = len(vm.statuses)
		vm.mu.Unlock()
		for _, st := range news {
			if match(st) {
				return st, nil
			}
		}
		if err := vm.waitPoll(ctx, &exitSeen); err != nil {
			return Status{}, fmt.Errorf("waiting for a matching VMSNAP status line: %w", err)
		}
	}
}

// WaitReady waits for the guest's "VMSNAP ready" line and returns what it
// says as a Status with Counter 0. A restored guest never prints it again
// (it did so before the checkpoint): use WaitStatus there.
func (vm *VM) WaitReady(ctx context.Context) (Status, error) {
	exitSeen := false
	for {
		if err := vm.poll(); err != nil {
			return Status{}, fmt.Errorf("reading the serial log: %w", err)
		}
		vm.mu.Lock()
		ready := vm.ready
		vm.mu.Unlock()
		if ready != nil {
			return *ready, nil
		}
		if err := vm.waitPoll(ctx, &exitSeen); err != nil {
			return Status{}, fmt.Errorf("waiting for VMSNAP ready: %w", err)
		}
	}
}

// ReadyCount is how many "VMSNAP ready" lines the serial log holds: more than
// one means the guest rebooted.
func (vm *VM) ReadyCount() int {
	_ = vm.poll()
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return vm.readyCount
}

// waitPoll sleeps until the next poll; it fails when ctx ends or QEMU has
// exited (after one last look at the log).
func (vm *VM) waitPoll(ctx context.Context, exitSeen *bool) error {
	select {
	case <-ctx.Done():
		return fmt.Errorf("%w (%s ran for %s; serial log tail:\n%s)", ctx.Err(), vm.name,
			time.Since(vm.started).Round(time.Millisecond), vm.SerialTail(10))
	case <-vm.done:
		// The log may have gained lines before the exit: let the caller
		// look once more before failing.
		if *exitSeen {
			return fmt.Errorf("%s exited (%v); stderr:\n%s\nserial log tail:\n%s", vm.name, vm.waitErr, vm.Stderr(), vm.SerialTail(10))
		}
		*exitSeen = true
		return nil
	case <-time.After(100 * time.Millisecond):
		return nil
	}
}

// PartialLine is the text after the serial log's last newline: a line the
// guest was printing when it was stopped (or is printing right now).
func (vm *VM) PartialLine() string {
	b, err := os.ReadFile(vm.serialPath)
	if err != nil {
		return ""
	}
	if i := bytes.LastIndexByte(b, '\n'); i >= 0 {
		b = b[i+1:]
	}
	return strings.TrimRight(string(b), "\r")
}

// ResumeCounter is the counter of the first complete status line that a
// copy of this guest, checkpointed now, prints once restored: the last
// complete line's counter + 1, or + 2 when the log ends inside a status line
// (the restored guest prints that line's rest, which alone does not parse).
// Call it once the guest is stopped.
func (vm *VM) ResumeCounter() int {
	last, _ := vm.LastStatus()
	next := last.Counter + 1
	if p := vm.PartialLine(); p != "" && (strings.Contains(p, "VMSNAP counter=") || strings.HasPrefix("VMSNAP counter=", p)) {
		next++
	}
	return next
}

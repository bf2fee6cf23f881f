package guest

import (
	"fmt"
	"strings"
	"testing"
)

// recordingTB records what SkipOrFail asks of a test instead of doing it.
type recordingTB struct {
	testing.TB
	fatal, skip string
}

func (r *recordingTB) Helper()                        {}
func (r *recordingTB) Fatalf(format string, a ...any) { r.fatal = fmt.Sprintf(format, a...) }
func (r *recordingTB) Skipf(format string, a ...any)  { r.skip = fmt.Sprintf(format, a...) }

// Every harness skips a missing real part loudly, with the reason, and
// under VMSNAP_TEST_REQUIRE_QEMU (CI) fails instead: never a silent pass.
func TestSkipOrFail(t *testing.T) {
	t.Setenv(EnvRequireQEMU, "1")
	r := &recordingTB{TB: t}
	SkipOrFail(r, "real containerd", "runc not found")
	if !strings.Contains(r.fatal, "real containerd") || !strings.Contains(r.fatal, "runc not found") {
		t.Fatalf("with %s set: failed with %q", EnvRequireQEMU, r.fatal)
	}

	t.Setenv(EnvRequireQEMU, "")
	r = &recordingTB{TB: t}
	SkipOrFail(r, "real containerd", "runc not found")
	if r.fatal != "" || !strings.Contains(r.skip, "runc not found") {
		t.Fatalf("without %s: fatal %q, skip %q; want a skip with the reason", EnvRequireQEMU, r.fatal, r.skip)
	}
}

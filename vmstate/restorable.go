package vmstate

import (
	"context"
	"fmt"
	"os"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// checkRestorable is Restore's compatibility check: CheckCompatible, plus,
// for a mapped-ram image, the target's mapped-ram capability, so that a
// QEMU that cannot load the file is refused with every difference at once
// and before anything is fed. A stream image costs no QMP command more.
func checkRestorable(ctx context.Context, mon Executor, cfg Config, manifest digest.Digest, target Record, prepared *os.File) error {
	diffs := Compare(cfg.Record, target)
	format := ""
	if cfg.Format == FormatMemoryFile {
		more, err := checkMemoryFileTarget(ctx, mon, cfg, manifest, target, prepared)
		if err != nil {
			return err
		}
		diffs = append(diffs, more...)
	}
	if cfg.Format == FormatMappedRAM {
		caps, err := migrationCapabilities(ctx, mon)
		if err != nil {
			return err
		}
		if _, ok := caps[capMappedRAM]; !ok {
			format = fmt.Sprintf("the snapshot is in QEMU's mapped-ram format (QEMU 9.0 or later), which this QEMU %s cannot load; ", target.QEMUVersion)
			diffs = append(diffs, fmt.Sprintf("migration format: snapshot is %s (saved by QEMU %s), target QEMU %s lacks the mapped-ram migration capability", FormatMappedRAM, cfg.Record.QEMUVersion, target.QEMUVersion))
		}
	}
	if len(diffs) == 0 {
		return nil
	}
	return errcode.WithDetails(errcode.CompatMismatch, diffs,
		"the waiting QEMU cannot load this snapshot (%d difference(s)): %sstart it with the same machine, CPU, memory and devices as the source", len(diffs), format)
}

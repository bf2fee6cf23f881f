package vmstate

import (
	"context"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// TestParseModeAndFormat pins the names the command line accepts and the
// USAGE message that lists them, the same for a checkpoint's options.
func TestParseModeAndFormat(t *testing.T) {
	if m, err := vmspec.ParseMode("live"); err != nil || m != ModeLive {
		t.Fatalf("ParseMode(live) = %q, %v", m, err)
	}
	for _, s := range []string{"", "auto"} {
		if f, err := vmspec.ParseFormat(s); err != nil || f != FormatAuto {
			t.Fatalf("vmspec.ParseFormat(%q) = %q, %v", s, f, err)
		}
	}
	if f, err := vmspec.ParseFormat("memory-file"); err != nil || f != FormatMemoryFile {
		t.Fatalf("vmspec.ParseFormat(memory-file) = %q, %v", f, err)
	}
	_, modeErr := vmspec.ParseMode("teleport")
	_, formatErr := vmspec.ParseFormat("tape")
	_, chooseErr := chooseFormat(context.Background(), nil, CheckpointOptions{Format: "tape"}, Record{})
	for _, c := range []struct {
		err  error
		want string
	}{
		{modeErr, `unknown mode "teleport": use pause, snapshot or live`},
		{formatErr, `unknown state format "tape": use auto, stream, mapped-ram or memory-file`},
		{chooseErr, `unknown state format "tape": use auto, stream, mapped-ram or memory-file`},
	} {
		if errcode.Of(c.err) != errcode.Usage || c.err.Error() != c.want {
			t.Errorf("got %v (%s), want USAGE %q", c.err, errcode.Of(c.err), c.want)
		}
	}
}

package vmstate

import (
	"context"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// TestParseModeAndFormat pins the names the command line accepts and the
// USAGE message that lists them, the same for a checkpoint's options.
func TestParseModeAndFormat(t *testing.T) {
	if m, err := ParseMode("live"); err != nil || m != ModeLive {
		t.Fatalf("ParseMode(live) = %q, %v", m, err)
	}
	for _, s := range []string{"", "auto"} {
		if f, err := ParseFormat(s); err != nil || f != FormatAuto {
			t.Fatalf("ParseFormat(%q) = %q, %v", s, f, err)
		}
	}
	if f, err := ParseFormat("memory-file"); err != nil || f != FormatMemoryFile {
		t.Fatalf("ParseFormat(memory-file) = %q, %v", f, err)
	}
	_, modeErr := ParseMode("teleport")
	_, formatErr := ParseFormat("tape")
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

package vmstate

import (
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// Mode is vmspec.Mode, by the name vmstate's own code uses (one type:
// defined in the leaf so that agent/api carries it without vmstate).
type Mode = vmspec.Mode

// The modes (vmspec).
const (
	ModePause    = vmspec.ModePause
	ModeSnapshot = vmspec.ModeSnapshot
	ModeLive     = vmspec.ModeLive
)

// unknownName is USAGE for a value that is none of names (what names the
// option in the error, which lists them).
func unknownName[T ~string](what, s string, names ...T) error {
	list := make([]string, len(names))
	for i, n := range names {
		list[i] = string(n)
	}
	last := len(list) - 1
	return errcode.New(errcode.Usage, "unknown %s %q: use %s or %s", what, s, strings.Join(list[:last], ", "), list[last])
}

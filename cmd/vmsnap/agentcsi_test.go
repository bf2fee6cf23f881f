package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// The agent refuses CSI flags it cannot serve before it starts anything.
func TestAgentCSIFlagsChecked(t *testing.T) {
	t.Setenv("NODE_NAME", "")
	dir := t.TempDir()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--csi-kubelet-dir", "/var/lib/kubelet"}, "needs the node's name"},
		{[]string{"--csi-kubelet-dir", "var/lib/kubelet", "--node-name", "n1"}, "absolute path"},
	} {
		var stdout, stderr bytes.Buffer
		args := append([]string{"agent", "--socket", filepath.Join(dir, "a.sock"), "--state-dir", dir}, tc.args...)
		if code := run(context.Background(), args, &stdout, &stderr); code != errcode.Usage.ExitStatus() || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("agent %q: exit %d, %s; want USAGE saying %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

func TestPruneHelpAndUsage(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"prune", "--help"}, &stdout, &stderr); code != 0 {
		t.Fatalf("prune --help: exit %d", code)
	}
	for _, want := range []string{"Usage:", "--keep", "--dry-run", "--json", "--registry-config", "--ca-file", "--insecure-registry",
		"dev.vmsnap.previous", "storage.delete", "Never deleted", "Exit status"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("prune --help lacks %q", want)
		}
	}
	dir := t.TempDir()
	cliError(t, errcode.Usage, "prune", "oci:"+dir)
	cliError(t, errcode.Usage, "prune", "oci:"+dir, "--keep", "0")
	cliError(t, errcode.Usage, "prune", "oci:"+dir+":vm", "--keep", "1")
	cliError(t, errcode.Usage, "prune", "--keep", "1")
	cliError(t, errcode.RegistryError, "prune", "oci:"+filepath.Join(dir, "missing"), "--keep", "1")
	cliError(t, errcode.Usage, "checkpoint", "--qmp", "/nonexistent", "--image", "oci:"+dir+":vm", "--keep", "-1")
}

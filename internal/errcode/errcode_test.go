package errcode

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"syscall"
	"testing"
)

func TestWrapKeepsTheWrappersCode(t *testing.T) {
	inner := New(QMPError, "qmp: stop: refused")
	err := Wrap(RegistryError, inner, "storing")
	if Of(err) != RegistryError || !errors.Is(err, inner) {
		t.Fatalf("Wrap = %v (%s)", err, Of(err))
	}
	if Ensure(Internal, inner, "x") != inner {
		t.Fatal("Ensure replaced a coded error")
	}
	if err := Ensure(RegistryError, errors.New("boom"), "storing"); Of(err) != RegistryError || err.Error() != "storing: boom" {
		t.Fatalf("Ensure = %v (%s)", err, Of(err))
	}
}

// A full disk has one code and one piece of advice wherever it is wrapped,
// and whatever code the wrapper had in mind.
func TestFullDiskIsAlwaysNoSpace(t *testing.T) {
	write := &fs.PathError{Op: "write", Path: "/var/lib/vmsnap/stage/blobs/sha256/.abc.tmp", Err: syscall.ENOSPC}
	for name, err := range map[string]error{
		"Wrap as REGISTRY_ERROR": Wrap(RegistryError, write, "cannot write blob %s", "sha256:abc"),
		"Ensure":                 Ensure(QMPError, fmt.Errorf("copying: %w", write), "copying"),
		"Wrap of a coded error":  Wrap(RegistryError, Wrap(Internal, write, "writing the blob"), "staging"),
	} {
		if Of(err) != NoSpace {
			t.Errorf("%s: code %s, want %s", name, Of(err), NoSpace)
		}
		msg := err.Error()
		if !strings.Contains(msg, "no space left on device") ||
			strings.Count(msg, "the filesystem holding /var/lib/vmsnap/stage/blobs/sha256 is full: free space there, then try again") != 1 {
			t.Errorf("%s: %s", name, msg)
		}
		if !errors.Is(err, syscall.ENOSPC) {
			t.Errorf("%s: ENOSPC is lost: %v", name, err)
		}
	}

	quota := Wrap(RegistryError, &os.LinkError{Op: "rename", Old: "/a/.x.tmp", New: "/a/x", Err: syscall.EDQUOT}, "moving x into place")
	if Of(quota) != NoSpace || !strings.HasSuffix(quota.Error(), "the filesystem holding /a is full: free space there or raise the quota, then try again") {
		t.Errorf("quota: %s (%s)", quota, Of(quota))
	}
	bare := Wrap(RegistryError, syscall.ENOSPC, "syncing")
	if Of(bare) != NoSpace || !strings.HasSuffix(bare.Error(), "the local disk is full: free space there, then try again") {
		t.Errorf("no path: %s (%s)", bare, Of(bare))
	}
}

// A library names the request field; WithFieldNames writes it as the CLI
// names it, through *Error wrappers and wrappers from elsewhere, keeping the
// code, the details and the rest of every message.
func TestWithFieldNames(t *testing.T) {
	inner := New(Internal, "staging directory /s is full: pick another with %s", Field("stagingDir"))
	if inner.Error() != "staging directory /s is full: pick another with `stagingDir`" {
		t.Fatalf("library text: %q", inner.Error())
	}
	err := WithDetails(RegistryError, []string{"d1"}, "outer")
	err.(*Error).Err = fmt.Errorf("%w; the VM was continued", Wrap(Usage, inner, "saving"))
	flag := func(f Field) string { return "--staging-dir" }
	got := WithFieldNames(err, flag)
	want := "outer: d1: saving: staging directory /s is full: pick another with --staging-dir; the VM was continued"
	if got.Error() != want {
		t.Fatalf("CLI text:\n%q\nwant\n%q", got.Error(), want)
	}
	if Of(got) != RegistryError || len(DetailsOf(got)) != 1 || !errors.Is(got, inner) {
		t.Fatalf("renamed error lost its code, details or chain: %v", got)
	}
	if strings.Contains(err.Error(), "--") {
		t.Fatalf("the original error changed: %v", err)
	}
	plain := New(Usage, "no field here: 100%%")
	if WithFieldNames(plain, flag) != plain {
		t.Fatal("an error without fields was copied")
	}
}

// A message that crossed the agent's API as text names its fields quoted:
// the CLI renames those, and nothing else in the message.
func TestRenameQuotedFields(t *testing.T) {
	msg := New(Usage, "the format of %s is wrong: give %s", Field("format"), Field("stagingDir")).Error()
	got := RenameQuotedFields(msg, func(f Field) string { return "--" + string(f) })
	if want := "the format of --format is wrong: give --stagingDir"; got != want {
		t.Fatalf("%q, want %q", got, want)
	}
	if plain := "no `Field` here, nor `two words`"; RenameQuotedFields(plain, func(Field) string { return "X" }) != plain {
		t.Fatal("renamed what is no field name")
	}
}

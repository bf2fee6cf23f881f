package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

func TestErrorRoundTripKeepsCodeAndDetails(t *testing.T) {
	err := errcode.WithDetails(errcode.CompatMismatch, []string{"memory differs", "CPU differs"}, "the waiting QEMU cannot load this snapshot")
	e := ErrorOf(err)
	if e.Code != errcode.CompatMismatch || len(e.Details) != 2 || strings.Contains(e.Message, "memory differs") {
		t.Fatalf("ErrorOf = %+v: details must be listed once, not repeated in the message", e)
	}
	b, _ := json.Marshal(ErrorDoc{Error: e})
	var back ErrorDoc
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	var asErr error = &back.Error
	wrapped := fmt.Errorf("agent: %w", asErr)
	if errcode.Of(wrapped) != errcode.CompatMismatch || len(errcode.DetailsOf(wrapped)) != 2 || !errcode.Has(wrapped) {
		t.Fatalf("a decoded error lost its code or details: %v", wrapped)
	}
	if got := errcode.Ensure(errcode.QMPError, wrapped, "x"); !errors.Is(got, asErr) || errcode.Of(got) != errcode.CompatMismatch {
		t.Fatalf("Ensure replaced a foreign code: %v", errcode.Of(got))
	}
}

func TestTruncatedFitsTerminationLog(t *testing.T) {
	var details []string
	for i := range 200 {
		details = append(details, fmt.Sprintf("PCI device missing on target: 00:%02x.0 1af4:1000 class=0200 id=net%d", i, i))
	}
	e := ErrorOf(errcode.WithDetails(errcode.CompatMismatch, details, "%s", strings.Repeat("m", 300)))
	got := e.Truncated(4096)
	b, _ := json.Marshal(ErrorDoc{Error: got})
	if len(b) > 4096 {
		t.Fatalf("%d bytes after truncation", len(b))
	}
	if got.Code != errcode.CompatMismatch || len(got.Details) < 10 || !strings.HasPrefix(got.Details[len(got.Details)-1], "... and ") {
		t.Fatalf("truncation lost too much or says nothing of it: %d details, last %q", len(got.Details), got.Details[len(got.Details)-1])
	}
	huge := Error{Code: errcode.Internal, Message: strings.Repeat("x", 10000)}.Truncated(4096)
	if b, _ := json.Marshal(ErrorDoc{Error: huge}); len(b) > 4096 {
		t.Fatalf("a huge message still takes %d bytes", len(b))
	}
}

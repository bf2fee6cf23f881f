package manifests

import (
	"strings"
	"testing"
)

// Validate's message lists every problem in the order of the checks, the
// same on every call: a map ranged over would shuffle it from run to run.
func TestValidateMessageOrderIsStable(t *testing.T) {
	o := Options{
		Namespace:                "Bad_NS",
		DecryptionKeySecret:      "Dec Key",
		AgentRecipientSecret:     "Recipient Key",
		AgentDecryptionKeySecret: "Agent Dec Key",
		CheckpointMode:           "fast",
		StateDir:                 "relative",
	}
	first := o.Validate()
	if first == nil {
		t.Fatal("invalid options were accepted")
	}
	want := []string{`Namespace "Bad_NS"`, `DecryptionKeySecret "Dec Key"`, `AgentRecipientSecret "Recipient Key"`,
		`AgentDecryptionKeySecret "Agent Dec Key"`, `CheckpointMode "fast"`, `StateDir "relative"`}
	msg, at := first.Error(), -1
	for _, w := range want {
		i := strings.Index(msg, w)
		if i <= at {
			t.Fatalf("%s is missing or out of order (want %q in this order) in:\n%s", w, want, msg)
		}
		at = i
	}
	for range 100 {
		if err := o.Validate(); err == nil || err.Error() != msg {
			t.Fatalf("Validate's message changed between calls:\n%s\n%v", msg, err)
		}
	}
}

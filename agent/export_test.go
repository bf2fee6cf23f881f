package agent

import (
	"testing"

	"github.com/vmsnap/vmsnap/internal/testing/hook"
)

// For the tests of package agent_test, which can import agent/containerd
// (package agent's own tests cannot: it imports agent).

// SetAfterResolve runs f in every checkpoint between resolving the VM and
// using what was resolved, until the test ends.
func SetAfterResolve(t testing.TB, f func()) {
	t.Cleanup(hook.Swap(&hook.AfterResolve, f))
}

// SetBeforeDiskCapture runs f in every checkpoint just before the disk
// overlay is read, the VM stopped, until the test ends.
func SetBeforeDiskCapture(t testing.TB, f func()) {
	t.Cleanup(hook.Swap(&hook.BeforeDiskCapture, f))
}

// StartTestAgent runs an agent with resolver until the test ends and
// returns its client.
func StartTestAgent(t *testing.T, resolver Resolver) *Client {
	t.Helper()
	return startAgentWith(t, resolver).client
}

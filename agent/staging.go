package agent

// stagingOwner is whom the staging files of an operation on the VM t count
// for when its QEMU keeps one after the operation (vmstate's
// maxKeptStaging): the VM's namespace, so that one tenant's QEMUs cannot
// stop the staging of every other's. A VM in no namespace counts as the
// node's.
func stagingOwner(t Target) string {
	if t.Namespace == "" {
		return "the node"
	}
	return "namespace " + t.Namespace
}

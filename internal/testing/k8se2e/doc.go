// Package k8se2e holds vmsnap's end-to-end test on a real single-node
// Kubernetes cluster (internal/testing/cluster): the agent DaemonSet applied as
// `vmsnap manifests --part agent` prints it, a test guest in QEMU in a pod
// of a namespace at the restricted Pod Security level, a checkpoint Job
// built with manifests.CheckpointJob, the restored pod of `vmsnap manifests
// --part restore`, and what happens when its containers restart. It has no
// code outside its test.
package k8se2e

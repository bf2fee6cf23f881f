// Package csi is the agent's CSI node plugin: the kubelet's way to give a
// restored pod the RAM file of a memory-file snapshot through an inline
// ephemeral volume, which the restricted Pod Security Standard allows where a
// hostPath would not be.
//
// It owns the gRPC surface the kubelet talks to: plugin registration
// (k8s.io/kubelet pluginregistration v1), the CSI Identity service and the
// Node service's publish and unpublish. It turns a NodePublishVolume request
// into a checked Publication (the pod's namespace and UID as the kubelet
// reported them, the image pinned by digest, the target in the form the
// kubelet makes) and hands it to a Publisher, which the agent implements:
// policy, the node's RAM cache and the mount are the agent's and the
// mounter's jobs, not this package's.
//
// It must not open or mount anything, and must not trust a volume attribute
// for who is asking: the kubelet writes the pod's identity after the pod's
// own attributes, so only the csi.storage.k8s.io/pod.* keys say who asks.
package csi

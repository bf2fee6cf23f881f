//go:build tools

// Package tools pins the Kubernetes commands internal/testing/cluster builds for
// the single-node test cluster: go.mod requires k8s.io/kubernetes and
// replaces each staging module it names with the same release (v0.x), which
// is how k8s.io/kubernetes can be built outside its own repository.
package tools

import (
	_ "k8s.io/kubectl/pkg/cmd"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)

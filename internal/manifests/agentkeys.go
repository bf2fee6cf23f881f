package manifests

import (
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// NamespaceKeySecret gives one namespace a private key in the agent: Secret,
// in the agent's namespace, has a key key.pem (as DecryptionKeySecret's).
type NamespaceKeySecret struct {
	Namespace, Secret string
}

// String is the form of the --namespace-key-secret flag: NAMESPACE=SECRET.
func (n NamespaceKeySecret) String() string { return n.Namespace + "=" + n.Secret }

// agentHasKeys: the agent gets a --decryption-key-dir.
func agentHasKeys(o Options) bool {
	return o.AgentDecryptionKeySecret != "" || len(o.NamespaceKeySecrets) > 0
}

// agentKeysVolume is the agent's --decryption-key-dir as one projected
// volume: AgentDecryptionKeySecret's keys at its top (the node's, for
// admin callers), and each NamespaceKeySecret's key.pem as
// NAMESPACE/SECRET.pem (that namespace's). Mode 0440 root:root: the
// agent's only. One volume, so that the kubelet updates it as a whole
// when a Secret changes, and the agent reads every set anew per request.
func agentKeysVolume(o Options) corev1.Volume {
	var sources []corev1.VolumeProjection
	if o.AgentDecryptionKeySecret != "" {
		sources = append(sources, corev1.VolumeProjection{Secret: &corev1.SecretProjection{
			LocalObjectReference: corev1.LocalObjectReference{Name: o.AgentDecryptionKeySecret},
		}})
	}
	for _, n := range o.NamespaceKeySecrets {
		sources = append(sources, corev1.VolumeProjection{Secret: &corev1.SecretProjection{
			LocalObjectReference: corev1.LocalObjectReference{Name: n.Secret},
			Items:                []corev1.KeyToPath{{Key: DecryptionKeyName, Path: n.Namespace + "/" + n.Secret + ".pem"}},
		}})
	}
	return corev1.Volume{Name: volDecryptionKeys, VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
		Sources: sources, DefaultMode: ptr(int32(0o440)),
	}}}
}

// validateKeySecrets checks NamespaceKeySecrets: namespaces and Secret
// names, each pair once.
func validateKeySecrets(o Options, bad func(string, ...any)) {
	for i, n := range o.NamespaceKeySecrets {
		if len(n.Namespace) > 63 || !dnsLabel.MatchString(n.Namespace) {
			bad("NamespaceKeySecrets: %q is not a namespace name", n.Namespace)
		}
		if !isSecretName(n.Secret) {
			bad("NamespaceKeySecrets: %q is not a Secret name", n.Secret)
		}
		if slices.Contains(o.NamespaceKeySecrets[:i], n) {
			bad("NamespaceKeySecrets: %s is given twice", n)
		}
	}
}

func isSecretName(s string) bool {
	return len(s) <= 253 && dnsLabel.MatchString(strings.ReplaceAll(s, ".", "-"))
}

// ParseNamespaceKeySecret reads NAMESPACE=SECRET.
func ParseNamespaceKeySecret(s string) (NamespaceKeySecret, error) {
	ns, secret, ok := strings.Cut(s, "=")
	if !ok || ns == "" || secret == "" {
		return NamespaceKeySecret{}, fmt.Errorf("%q: give NAMESPACE=SECRET", s)
	}
	return NamespaceKeySecret{Namespace: ns, Secret: secret}, nil
}

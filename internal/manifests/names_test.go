package manifests

import (
	"strings"
	"testing"
)

// A user's ConfigMap may be named like one of our own volumes (the natural
// name for a registry CA is the volume's own): the agent's DaemonSet and
// the restored pod must still render, each with the CA's comment above
// the ConfigMap reference.
func TestRenderWithACAConfigMapNamedLikeOurVolume(t *testing.T) {
	for _, name := range []string{VolumeRegistryCA, VolumeRegistry, "registry-ca"} {
		r := render(t, Options{Image: "vmsnap.test/vmsnap:e2e", RegistryCAConfigMap: name})
		for _, kind := range []string{"DaemonSet", "Pod"} {
			if why := commentAbove(t, r.doc(t, kind), "- configMap:"); !strings.Contains(why, "ConfigMap "+name) {
				t.Errorf("%s with ConfigMap %q: the comment above its configMap volume is %q", kind, name, why)
			}
		}
	}
}

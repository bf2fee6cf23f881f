package agent

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/csi"
	"github.com/vmsnap/vmsnap/agent/mounter"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
)

// A publish decrypts with the keys of the pod's namespace, and no other's:
// an image encrypted for tenant-a is published for tenant-a's pod, and a
// pod of tenant-b (same allowed repository, its own key) gets nothing, not
// even a file in its cache.
func TestCSIPublishDecryptsWithThePodsNamespaceKeys(t *testing.T) {
	reg := registry.Start(t)
	store := []ociimage.Option{ociimage.WithRegistryConfig(reg.ConfigDir), ociimage.WithCAFile(reg.CAFile)}
	keys := t.TempDir()
	keyA := writeKey(t, filepath.Join(keys, "tenant-a", "key.pem"))
	writeKey(t, filepath.Join(keys, "tenant-b", "key.pem"))
	img, _, _ := memoryFileCheckpoint(t, reg.Host+"/vms/enc:a", [3]int{10, 0, 2}, 1<<20,
		append(store, imgcrypt.WithEncryption(imgcrypt.EncryptOptions{Recipients: []imgcrypt.Recipient{keyA.Recipient()}}))...)
	stateDir := t.TempDir()
	s := startAgentConfig(t, Config{StateDir: stateDir, Resolver: newStaticResolver(), AllowRepositories: []string{reg.Host + "/vms"},
		Store: store, DecryptionKeyDir: keys}).srv
	m := &fakeMounter{}
	p := s.CSIPublisher(m)
	publication := func(ns, uid string) csi.Publication {
		return csi.Publication{VolumeID: mounter.VolumeHandle(uid, "ram"), Target: "/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi/ram/mount",
			Pod: csi.Pod{Namespace: ns, Name: "restore", UID: uid}, Image: img, ReadOnly: true}
	}

	err := p.Publish(context.Background(), publication("tenant-b", "0b6a4a5e-35c1-4a7c-9f0e-6a2d3c1b9e1b"))
	if err == nil || !strings.Contains(err.Error(), "decrypt") {
		t.Fatalf("tenant-b's pod, for an image encrypted for tenant-a only: %v; want a refusal to decrypt", err)
	}
	if len(m.published) != 0 {
		t.Errorf("the mounter was asked to publish %+v", m.published)
	}
	des, _ := os.ReadDir(RAMCacheDir(stateDir, "tenant-b"))
	for _, de := range des {
		if strings.HasSuffix(de.Name(), ".ram") || de.Name() == "pub" {
			t.Errorf("tenant-b's cache holds %s after a refused publish", de.Name())
		}
	}
	if err := p.Publish(context.Background(), publication("tenant-a", "0b6a4a5e-35c1-4a7c-9f0e-6a2d3c1b9e1a")); err != nil {
		t.Fatalf("tenant-a's pod, whose namespace has the key: %v", err)
	}
	if len(m.published) != 1 {
		t.Errorf("the mounter was asked %+v; want tenant-a's one publish", m.published)
	}
}

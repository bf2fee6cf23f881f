package manifests

import (
	"slices"
	"testing"

	psa "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
)

// With DecryptionKeySecret, the restore init container (and it alone)
// mounts the key 0440, passes its path as --decryption-key, and the pod
// has the fsGroup that lets the non-root container read it; the pod stays
// admissible under restricted.
func TestRestoreWithDecryptionKeySecret(t *testing.T) {
	o := Options{DecryptionKeySecret: "vm-keys"}
	r := render(t, o)
	pod := r.pod
	var ic *int
	for i, c := range pod.Spec.InitContainers {
		if c.Name == RestoreContainerName {
			ic = &i
		}
	}
	if ic == nil {
		t.Fatal("no restore init container")
	}
	c := pod.Spec.InitContainers[*ic]
	i := slices.Index(c.Command, "--decryption-key")
	if i < 0 || i+1 >= len(c.Command) || c.Command[i+1] != DecryptionKeyDir+"/"+DecryptionKeyName {
		t.Fatalf("command %q lacks --decryption-key %s/%s", c.Command, DecryptionKeyDir, DecryptionKeyName)
	}
	mounted := 0
	for _, cc := range append(append(pod.Spec.InitContainers[:0:0], pod.Spec.InitContainers...), pod.Spec.Containers...) {
		for _, m := range cc.VolumeMounts {
			if m.Name == VolumeDecryptionKey {
				mounted++
				if cc.Name != RestoreContainerName || !m.ReadOnly || m.MountPath != DecryptionKeyDir {
					t.Errorf("container %s mounts the key at %s (read-only %v)", cc.Name, m.MountPath, m.ReadOnly)
				}
			}
		}
	}
	if mounted != 1 {
		t.Errorf("the key is mounted %d times, want once (the restore init container)", mounted)
	}
	var found bool
	for _, v := range pod.Spec.Volumes {
		if v.Name != VolumeDecryptionKey {
			continue
		}
		found = true
		if v.Secret == nil || v.Secret.SecretName != "vm-keys" || v.Secret.DefaultMode == nil || *v.Secret.DefaultMode != 0o440 ||
			len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != DecryptionKeyName {
			t.Errorf("key volume %+v", v)
		}
	}
	if !found {
		t.Fatal("no key volume")
	}
	if sc := pod.Spec.SecurityContext; sc == nil || sc.FSGroup == nil || *sc.FSGroup != DefaultNonRootUser {
		t.Errorf("pod security context %+v: want fsGroup %d", sc, DefaultNonRootUser)
	}
	eval, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	res := policy.AggregateCheckResults(eval.EvaluatePod(psa.LevelVersion{Level: psa.LevelRestricted, Version: psa.LatestVersion()}, &pod.ObjectMeta, &pod.Spec))
	if !res.Allowed {
		t.Fatalf("not admissible under restricted: %s", res.ForbiddenDetail())
	}

	// Without it, nothing of the kind.
	plain := render(t, Options{}).pod
	if slices.Contains(plain.Spec.InitContainers[1].Command, "--decryption-key") || plain.Spec.SecurityContext.FSGroup != nil {
		t.Error("a pod without DecryptionKeySecret has a decryption key or an fsGroup")
	}
	if err := (Options{DecryptionKeySecret: "Not A Name"}).Validate(); err == nil {
		t.Error("an invalid Secret name was accepted")
	}
}

// The agent's encryption Secrets: its recipient and its decryption keys,
// mounted in the agent alone and passed as --encrypt-recipient and
// --decryption-key-dir; never in a Job or the restored pod.
func TestAgentEncryptionSecrets(t *testing.T) {
	o := Options{AgentRecipientSecret: "rcpt", AgentDecryptionKeySecret: "dkeys"}
	r := render(t, o) // renders, comments placed
	args := AgentArgs(o)
	if i := slices.Index(args, "--encrypt-recipient"); i < 0 || args[i+1] != "jwe:"+AgentRecipientDir+"/"+AgentRecipientName {
		t.Errorf("agent args %q lack --encrypt-recipient", args)
	}
	if i := slices.Index(args, "--decryption-key-dir"); i < 0 || args[i+1] != AgentDecryptionKeyDir {
		t.Errorf("agent args %q lack --decryption-key-dir", args)
	}
	modes := map[string]int32{}
	for _, v := range DaemonSet(o).Spec.Template.Spec.Volumes {
		if v.Secret != nil && v.Secret.DefaultMode != nil {
			modes[v.Secret.SecretName] = *v.Secret.DefaultMode
		}
		if p := v.Projected; p != nil && p.DefaultMode != nil {
			for _, src := range p.Sources {
				if src.Secret != nil && len(src.Secret.Items) == 0 {
					modes[src.Secret.Name] = *p.DefaultMode
				}
			}
		}
	}
	if modes["rcpt"] != 0o444 || modes["dkeys"] != 0o440 {
		t.Errorf("secret modes %v, want rcpt 0444 (292), dkeys 0440 (288)", modes)
	}
	for _, c := range append(append(r.pod.Spec.InitContainers, r.pod.Spec.Containers...), CheckpointJob(o, Checkpoint{}).Spec.Template.Spec.Containers...) {
		for _, m := range c.VolumeMounts {
			if m.Name == volRecipient || m.Name == volDecryptionKeys {
				t.Errorf("container %s mounts the agent's %s", c.Name, m.Name)
			}
		}
	}
}

// Each namespace's own key: its Secret's key.pem lands in the agent's key
// directory as NAMESPACE/SECRET.pem, beside the node's keys at the top, in
// one projected volume (0440); the agent alone mounts it.
func TestAgentNamespaceKeySecrets(t *testing.T) {
	o := Options{AgentDecryptionKeySecret: "node-keys", NamespaceKeySecrets: []NamespaceKeySecret{{"tenant-a", "keys-a"}, {"tenant-a", "keys-a-next"}, {"tenant-b", "keys-b"}}}
	render(t, o) // renders, comments placed
	if i := slices.Index(AgentArgs(o), "--decryption-key-dir"); i < 0 || AgentArgs(o)[i+1] != AgentDecryptionKeyDir {
		t.Fatalf("agent args %q lack --decryption-key-dir", AgentArgs(o))
	}
	var got []string
	for _, v := range DaemonSet(o).Spec.Template.Spec.Volumes {
		if v.Name != volDecryptionKeys {
			continue
		}
		if v.Projected == nil || *v.Projected.DefaultMode != 0o440 {
			t.Fatalf("the key volume is not a projected one of mode 0440: %+v", v)
		}
		for _, src := range v.Projected.Sources {
			got = append(got, src.Secret.Name)
			for _, it := range src.Secret.Items {
				got = append(got, it.Key+"->"+it.Path)
			}
		}
	}
	want := []string{"node-keys", "keys-a", "key.pem->tenant-a/keys-a.pem", "keys-a-next", "key.pem->tenant-a/keys-a-next.pem", "keys-b", "key.pem->tenant-b/keys-b.pem"}
	if !slices.Equal(got, want) {
		t.Fatalf("key volume sources %q, want %q", got, want)
	}
	// Namespace keys alone are enough for a key directory.
	if !slices.Contains(AgentArgs(Options{NamespaceKeySecrets: o.NamespaceKeySecrets[:1]}), "--decryption-key-dir") {
		t.Error("namespace keys without node keys give no --decryption-key-dir")
	}
	for _, bad := range [][]NamespaceKeySecret{{{"Tenant_A", "k"}}, {{"tenant-a", "Not A Name"}}, {{"tenant-a", "k"}, {"tenant-a", "k"}}} {
		if err := (Options{NamespaceKeySecrets: bad}).Validate(); err == nil {
			t.Errorf("NamespaceKeySecrets %v: valid", bad)
		}
	}
}

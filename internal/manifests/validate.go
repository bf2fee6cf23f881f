package manifests

import (
	"fmt"
	"path"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Validate reports options that would render unusable or less safe
// manifests. The object constructors do not validate; Render does.
func (o Options) Validate() error {
	o = o.withDefaults()
	var errs []string
	// Every problem is reported, in the order the checks below find them.
	bad := func(format string, a ...any) { errs = append(errs, fmt.Sprintf(format, a...)) }

	validateNames(o, bad)
	validateKeySecrets(o, bad)
	validateAgentPolicy(o, bad)
	validateIdentities(o, bad)
	validateCapabilities(o, bad)
	if o.RestoreStateSizeLimit.Sign() < 0 || o.RestoreRAMSizeLimit.Sign() < 0 {
		bad("RestoreStateSizeLimit and RestoreRAMSizeLimit must not be negative")
	}
	if o.MemoryFile && o.RestoreViaAgent {
		bad("MemoryFile with RestoreViaAgent is not supported: the restored pod prepares its RAM file and loads the device state itself (leave RestoreViaAgent out)")
	}
	validateHostPaths(o, bad)
	validatePodPaths(o, bad)
	if len(errs) > 0 {
		return fmt.Errorf("manifests: invalid options: %s", strings.Join(errs, "; "))
	}
	return nil
}

// validateNames checks the names of objects, volumes and Secrets the manifests
// refer to, and OnRestart.
func validateNames(o Options, bad func(string, ...any)) {
	for _, n := range []struct{ what, v string }{
		{"Namespace", o.Namespace}, {"Name", o.Name}, {"RestoreStateVolume", o.RestoreStateVolume},
		{"RestoreDiskVolume", o.RestoreDiskVolume}, {"RestoreMarkerVolume", o.RestoreMarkerVolume},
		{"RestoreRunVolume", o.RestoreRunVolume}, {"RestoreRAMVolume", o.RestoreRAMVolume},
	} {
		if len(n.v) > 63 || !dnsLabel.MatchString(n.v) {
			bad("%s %q is not a DNS label", n.what, n.v)
		}
	}
	vols := []string{o.RestoreStateVolume, o.RestoreDiskVolume, o.RestoreMarkerVolume, o.RestoreRunVolume, o.RestoreRAMVolume, VolumeRegistry, VolumeRegistryCA}
	for i, v := range vols {
		if slices.Contains(vols[:i], v) {
			bad("the restored pod's volume name %q is used twice", v)
		}
	}
	if o.OnRestart != "cold" && o.OnRestart != "fail" {
		bad("OnRestart %q is not cold or fail", o.OnRestart)
	}
	if o.RegistryCAConfigMap != "" && (len(o.RegistryCAConfigMap) > 253 || !dnsLabel.MatchString(strings.ReplaceAll(o.RegistryCAConfigMap, ".", "-"))) {
		bad("RegistryCAConfigMap %q is not a ConfigMap name", o.RegistryCAConfigMap)
	}
	// A slice, not a map: the messages come in the order of the fields.
	for _, s := range []struct{ what, v string }{
		{"DecryptionKeySecret", o.DecryptionKeySecret}, {"AgentRecipientSecret", o.AgentRecipientSecret},
		{"AgentDecryptionKeySecret", o.AgentDecryptionKeySecret},
	} {
		if s.v != "" && !isSecretName(s.v) {
			bad("%s %q is not a Secret name", s.what, s.v)
		}
	}
}

// validateAgentPolicy checks what the agent allows and how it is deployed:
// repositories, admins, bounds, its image, node label and pull secret.
func validateAgentPolicy(o Options, bad func(string, ...any)) {
	for _, r := range o.AllowRepositories {
		if r == "" || strings.ContainsAny(r, " \t\n@") || strings.Contains(r, "://") || !strings.Contains(r, "/") {
			bad("AllowRepositories: %q is not HOST[:PORT]/PREFIX", r)
		}
	}
	for _, n := range o.AdminNamespaces {
		if len(n) > 63 || !dnsLabel.MatchString(n) {
			bad("AdminNamespaces: %q is not a namespace name", n)
		}
	}
	if o.OperationTimeout < 0 || o.MaxWorkers < 0 || o.RAMCacheMaxBytes < 0 {
		bad("OperationTimeout, MaxWorkers and RAMCacheMaxBytes must not be negative")
	}
	if len(o.Name) > 40 {
		bad("Name %q is too long to prefix object names", o.Name)
	}
	if strings.ContainsAny(o.Image, " \t\n") {
		bad("Image %q contains white space", o.Image)
	}
	key := o.KVMNodeLabel
	if i := strings.LastIndexByte(key, '/'); i >= 0 {
		key = key[i+1:]
	}
	if len(key) > 63 || !labelKeyName.MatchString(key) {
		bad("KVMNodeLabel %q is not a label key", o.KVMNodeLabel)
	}
	if o.KVMNodeLabelValue != "" && (len(o.KVMNodeLabelValue) > 63 || !labelKeyName.MatchString(o.KVMNodeLabelValue)) {
		bad("KVMNodeLabelValue %q is not a label value", o.KVMNodeLabelValue)
	}
	if !dnsLabel.MatchString(strings.ReplaceAll(o.PullSecret, ".", "-")) || len(o.PullSecret) > 253 {
		bad("PullSecret %q is not a Secret name", o.PullSecret)
	}
}

// validateIdentities checks the IDs containers run as, the checkpoint mode
// and the Jobs' deadlines.
func validateIdentities(o Options, bad func(string, ...any)) {
	if o.SocketGroup <= 0 {
		bad("SocketGroup %d must be a GID above 0", o.SocketGroup)
	}
	for _, u := range []struct {
		what string
		id   int64
	}{{"JobUser", o.JobUser}, {"RestoreUser", o.RestoreUser}, {"RestoreGroup", o.RestoreGroup}} {
		if u.id <= 0 {
			bad("%s %d must be above 0: that container runs as non-root", u.what, u.id)
		}
	}
	if !slices.Contains([]string{"pause", "snapshot", "live"}, o.CheckpointMode) {
		bad("CheckpointMode %q is not pause, snapshot or live", o.CheckpointMode)
	}
	if o.JobActiveDeadlineSeconds < 0 || o.JobTTLSecondsAfterFinished < 0 {
		bad("Job deadlines must not be negative")
	}
}

// validateCapabilities checks AgentExtraCapabilities: each a single
// capability the agent may hold, once.
func validateCapabilities(o Options, bad func(string, ...any)) {
	seen := map[corev1.Capability]bool{AgentCapability: true}
	for _, c := range o.AgentExtraCapabilities {
		switch {
		case !capName.MatchString(string(c)):
			bad("AgentExtraCapabilities: %q is not a capability name such as CHOWN", c)
		case c == "ALL" || strings.HasPrefix(string(c), "CAP_"):
			bad("AgentExtraCapabilities: %q: name one capability, without CAP_", c)
		case c == "SYS_ADMIN":
			bad("AgentExtraCapabilities: SYS_ADMIN cannot go with allowPrivilegeEscalation: false, and the agent does not need it")
		case seen[c]:
			bad("AgentExtraCapabilities: %s is already there", c)
		}
		seen[c] = true
	}
}

// validateHostPaths checks the node's paths the agent mounts: each clean,
// absolute and apart from the others, since each is mounted on its own.
func validateHostPaths(o Options, bad func(string, ...any)) {
	hostPaths := []struct{ what, p string }{
		{"SocketDir", o.SocketDir}, {"StateDir", o.StateDir},
		{"ContainerdSocket", o.ContainerdSocket}, {"ContainerdRoot", o.ContainerdRoot}, {"KubeletPodsDir", o.KubeletPodsDir},
	}
	if o.LayoutRoot != "" {
		hostPaths = append(hostPaths, struct{ what, p string }{"LayoutRoot", o.LayoutRoot})
	}
	for i, a := range hostPaths {
		if !cleanAbs(a.p) || a.p == "/" {
			bad("%s %q must be a clean absolute path below /", a.what, a.p)
			continue
		}
		for _, b := range hostPaths[:i] {
			if within(a.p, b.p) || within(b.p, a.p) {
				bad("%s %q and %s %q overlap: each host path is mounted on its own", a.what, a.p, b.what, b.p)
			}
		}
	}
}

// validatePodPaths checks the restored pod's paths: clean, absolute, safe in
// a shell command line, and on different volumes.
func validatePodPaths(o Options, bad func(string, ...any)) {
	podPaths := []struct{ what, p string }{
		{"RestoreStateDir", o.RestoreStateDir}, {"directory of RestoreDiskPath", path.Dir(o.RestoreDiskPath)},
		{"RestoreMarkerDir", o.RestoreMarkerDir}, {"directory of QMPSocket", path.Dir(o.QMPSocket)}, {"BaseDir", o.BaseDir},
		{"RestoreRAMDir", o.RestoreRAMDir},
		{"registry paths", "/etc/vmsnap"},
	}
	for i, a := range podPaths {
		if !cleanAbs(a.p) || a.p == "/" || !shellSafe.MatchString(a.p) {
			bad("%s %q must be a clean absolute path below / of letters, digits and _./+:@=-", a.what, a.p)
			continue
		}
		for _, b := range podPaths[:i] {
			if within(a.p, b.p) || within(b.p, a.p) {
				bad("%s %q and %s %q overlap: they are different volumes", a.what, a.p, b.what, b.p)
			}
		}
	}
	for _, f := range []struct{ what, p string }{{"RestoreDiskPath", o.RestoreDiskPath}, {"QMPSocket", o.QMPSocket}} {
		if !cleanAbs(f.p) || path.Dir(f.p) == "/" || !shellSafe.MatchString(f.p) {
			bad("%s %q must be a clean absolute path in a directory (its volume's mount point), of letters, digits and _./+:@=-", f.what, f.p)
		}
	}
}

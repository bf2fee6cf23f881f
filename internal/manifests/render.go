package manifests

import (
	"bytes"
	"encoding/json"
	"fmt"
	corev1 "k8s.io/api/core/v1"
	"path"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"
)

// Part selects what RenderParts writes.
type Part string

const (
	// PartAgent is what to apply: the Namespace (unless OmitNamespace),
	// the ServiceAccount and the agent's DaemonSet.
	PartAgent Part = "agent"
	// PartJob is the checkpoint Job template, for a controller to fill in.
	PartJob Part = "job"
	// PartRestore is a restored pod: the restore init container and QEMU
	// started by vmsnap launch.
	// It is a Pod with placeholders, to fill in and apply.
	PartRestore Part = "restore"
)

// Parts lists every part, in Render's order.
var Parts = []Part{PartAgent, PartJob, PartRestore}

// Render writes every part as one multi-document YAML stream, "---"
// separated, each object with its kind and apiVersion and with comments
// saying why each host path and privilege is there. The output depends on
// the options only.
func Render(o Options) ([]byte, error) { return RenderParts(o, Parts...) }

// RenderParts writes the given parts, in the given order.
func RenderParts(o Options, parts ...Part) ([]byte, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	o = o.withDefaults()
	var docs []document
	for _, p := range parts {
		switch p {
		case PartAgent:
			if !o.OmitNamespace {
				docs = append(docs, namespaceDoc(o))
			}
			docs = append(docs, serviceAccountDoc(o), daemonSetDoc(o))
		case PartJob:
			docs = append(docs, jobDoc(o))
		case PartRestore:
			docs = append(docs, restoreDoc(o))
		default:
			return nil, fmt.Errorf("manifests: unknown part %q (want agent, job or restore)", p)
		}
	}
	var out bytes.Buffer
	for i, d := range docs {
		if i > 0 {
			out.WriteString("---\n")
		}
		b, err := d.render()
		if err != nil {
			return nil, err
		}
		out.Write(b)
	}
	return out.Bytes(), nil
}

// A document is one object with its comments: a header block, and notes
// each placed on the line(s) just above one line of the marshalled YAML.
type document struct {
	header []string
	obj    any
	notes  []note
	// flow placeholders are list values of their own: "key:" followed by
	// the one item "- ${X}" is written "key: ${X}", for a JSON array.
	flow []string
	// repeated are note targets that may match several lines (a setting
	// of several containers): the comment goes above each.
	repeated []string
}

// A note explains the one line of a document that target picks: either
// the exact line, indentation aside ("- DAC_OVERRIDE"), or, ending in a
// colon, any line with that key ("nodeName:"). A target that matches no
// line, or more than one, is an error, so a change in the objects cannot
// silently move or drop a comment.
type note struct {
	target string
	why    string
}

func (n note) matches(trimmed string) bool {
	if strings.HasSuffix(n.target, ":") {
		return trimmed == n.target || strings.HasPrefix(trimmed, n.target+" ")
	}
	return trimmed == n.target
}

const commentWidth = 100

func (d document) render() ([]byte, error) {
	body, err := marshal(d.obj)
	if err != nil {
		return nil, fmt.Errorf("manifests: marshalling %T: %w", d.obj, err)
	}
	lines := strings.Split(strings.TrimSuffix(string(body), "\n"), "\n")
	for _, f := range d.flow {
		if lines, err = inlineFlow(lines, f); err != nil {
			return nil, err
		}
	}
	above := make(map[int][]string, len(d.notes))
	for _, n := range d.notes {
		var at []int
		for i, l := range lines {
			if n.matches(strings.TrimSpace(l)) {
				if len(at) > 0 && !slices.Contains(d.repeated, n.target) {
					return nil, fmt.Errorf("manifests: the comment for %q matches lines %d and %d of the %T", n.target, at[0]+1, i+1, d.obj)
				}
				at = append(at, i)
			}
		}
		if len(at) == 0 {
			return nil, fmt.Errorf("manifests: the comment for %q matches no line of the %T", n.target, d.obj)
		}
		for _, a := range at {
			indent := lines[a][:len(lines[a])-len(strings.TrimLeft(lines[a], " "))]
			above[a] = append(above[a], comment(indent, n.why, commentWidth)...)
		}
	}
	var out strings.Builder
	for _, h := range d.header {
		for _, l := range strings.Split(h, "\n") {
			out.WriteString(strings.TrimRight("# "+l, " ") + "\n")
		}
	}
	for i, l := range lines {
		for _, c := range above[i] {
			out.WriteString(c + "\n")
		}
		out.WriteString(l + "\n")
	}
	return []byte(out.String()), nil
}

// inlineFlow turns the one "key:" + "- X" pair into "key: X".
func inlineFlow(lines []string, x string) ([]string, error) {
	at := -1
	for i := 1; i < len(lines); i++ {
		if strings.TrimSpace(lines[i]) == "- "+x && strings.HasSuffix(lines[i-1], ":") {
			if at >= 0 {
				return nil, fmt.Errorf("manifests: %s is a list of its own twice", x)
			}
			at = i
		}
	}
	if at < 0 {
		return nil, fmt.Errorf("manifests: %s is not a list of its own", x)
	}
	out := append(append([]string(nil), lines[:at-1]...), lines[at-1]+" "+x)
	return append(out, lines[at+1:]...), nil
}

// marshal writes obj as YAML without its status, which is the cluster's to
// write, nor an empty spec.
func marshal(obj any) ([]byte, error) {
	j, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	var m map[string]any
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.UseNumber() // integers stay exactly as they are
	if err := dec.Decode(&m); err != nil {
		return nil, err
	}
	delete(m, "status")
	if spec, ok := m["spec"].(map[string]any); ok && len(spec) == 0 {
		delete(m, "spec")
	}
	if j, err = json.Marshal(m); err != nil {
		return nil, err
	}
	return yaml.JSONToYAML(j)
}

// comment wraps text into "# " lines at most width wide (a longer word gets
// a line of its own), each after indent.
func comment(indent, text string, width int) []string {
	return wrapWords(indent+"# ", strings.Fields(text), width)
}

func namespaceDoc(o Options) document {
	return document{
		header: []string{
			"vmsnap: the namespace of the agent and of the checkpoint Jobs. Pod Security is privileged",
			"(enforce, warn and audit alike) because the agent mounts host paths and shares the host's",
			"PID namespace, and every Job mounts the agent's socket directory: all outside baseline,",
			"so a baseline warning would fire on every Job and mean nothing. Only these run here. The",
			"agent lists this namespace as an --admin-namespace: Jobs from here act on tenants' VMs.",
			"Tenants' namespaces stay restricted: the restored pod (--part restore) meets it.",
		},
		obj: Namespace(o),
	}
}

func serviceAccountDoc(o Options) document {
	return document{
		header: []string{
			"vmsnap: the identity of the agent and the checkpoint Jobs. Neither calls the Kubernetes",
			"API (the agent asks containerd, the Job asks the agent), so it has no role and no token.",
		},
		obj: ServiceAccount(o),
	}
}

func jobDoc(o Options) document {
	t := TemplateCheckpoint
	h := []string{
		"vmsnap checkpoint Job: a TEMPLATE, not to be applied as is. A controller fills it in",
		"(CheckpointJob in Go; or envsubst with the names listed) and creates it in " + o.Namespace + ",",
		"on the source pod's node. Placeholders:",
	}
	h = append(h, placeholderLines(placeholders(t.Node, t.PodUID, t.Container, t.QMP, t.Disk, t.Image, t.DiskImage))...)
	h = append(h,
		"",
		"It asks the agent on its node to checkpoint the VM of pod $SOURCE_POD_UID (by UID, never",
		"by name) and writes the result JSON (digests, sizes, durations) to "+TerminationLog+":",
		"the controller reads it in the pod's status.containerStatuses[0].state.terminated.message.",
		"",
		"Host path: "+o.SocketDir+" only, read-only, to reach the agent's socket (connect() needs",
		"  no write access to the mount). Registry credentials: none; the agent pushes.",
		fmt.Sprintf("Privileges: none. Non-root (%d), supplementary group %d to connect to the", o.JobUser, o.SocketGroup),
		"  0660 socket, every capability dropped, read-only root filesystem, no privilege",
		"  escalation, seccomp RuntimeDefault.",
		"Namespace: "+o.Namespace+", the agent's, whose Pod Security level is privileged because of",
		"  the hostPath above (baseline forbids any hostPath); the agent lists it as an",
		"  --admin-namespace, so the Job may checkpoint a VM in a tenant's namespace.",
	)
	notes := []note{
		{"backoffLimit:", "Never retried: on failure the VM was continued; whether to try again is the controller's call."},
		{"activeDeadlineSeconds:", "An upper bound on the whole checkpoint, waiting for the agent included."},
		{"ttlSecondsAfterFinished:", "Long enough for the controller to read the result from the termination message."},
		{"nodeName:", "The source pod's node: the agent there is the one that can reach the VM."},
		{"- name: " + EnvSourcePodUID, "The source pod's UID; the command passes it as --pod-uid $(SOURCE_POD_UID)."},
		{"supplementalGroups:", fmt.Sprintf("Group %d owns the agent's socket (mode 0660): the only way in.", o.SocketGroup)},
		{"path: " + o.SocketDir, "The agent's socket directory, and nothing else of the node. Directory: no agent, no Job."},
		{"terminationMessagePolicy:", "File: the result JSON alone, not the progress lines of the log."},
	}
	return document{header: h, obj: JobTemplate(o), notes: notes}
}

// placeholderLines documents each placeholder with its meaning.
func placeholderLines(names []string) []string {
	var lines []string
	const col = "  " + "                  " // the meanings' column
	for _, n := range names {
		w := wrapWords(col, strings.Fields(Placeholders[n]), 96)
		w[0] = fmt.Sprintf("  %-17s %s", n, strings.TrimPrefix(w[0], col))
		lines = append(lines, w...)
	}
	return lines
}

func restoreDoc(o Options) document {
	pod := RestorePod(o)
	var vals []string
	for _, c := range append(append([]corev1.Container(nil), pod.Spec.InitContainers...), pod.Spec.Containers...) {
		vals = append(append(vals, c.Image), append(c.Command, c.Args...)...)
	}
	h := []string{
		"vmsnap restore: a pod restored from a checkpoint, a TEMPLATE. Fill in the placeholders",
		"(envsubst with the names listed, or RestoreInit and AddRestore in Go) and apply it. Placeholders:",
	}
	h = append(h, placeholderLines(placeholders(append([]string{pod.Name, pod.Namespace}, vals...)...))...)
	h = append(h,
		"",
		containerCount(o)+" containers, each non-root ("+fmt.Sprintf("%d:%d", o.RestoreUser, o.RestoreGroup)+": make it QEMU's user), read-only root",
		"  filesystem, every capability dropped, no privilege escalation, seccomp RuntimeDefault,",
		"  no hostPath: the restricted Pod Security Standard, met in a tenant's namespace.",
		"  "+BackingContainerName+" copies the overlay's backing file from "+o.BaseDir+" in the QEMU image",
		"    to the disk volume, beside the overlay, where QEMU resolves its relative name.",
	)
	h = append(h, restoreSteps(o)...)
	h = append(h,
		"One restore per snapshot, per pod: a snapshot's memory is loaded at most once.",
		"  A restarted qemu container (crash, OOM kill, guest poweroff, failed probe) finds the",
		"  launcher's marker in "+o.RestoreMarkerDir+" and (--on-restart "+o.OnRestart+") "+onRestartMeaning(o.OnRestart)+".",
		"  A re-run of the init containers (the pod's sandbox recreated, after a node reboot) finds",
		"  the restore's marker there and leaves the overlay the guest has written to as it is.",
		"  The markers are on an emptyDir, on disk: it lives exactly as long as the pod (container",
		"  restarts and sandbox recreation included). Not beside the overlay on a PVC: that outlives",
		"  the pod, and a new pod restoring the same snapshot onto it must restore again.",
		"",
		"Registry credentials: Secret "+o.PullSecret+" (kubernetes.io/dockerconfigjson) in the pod's",
		"  namespace, mounted read-only as "+RegistryConfigDir+"/config.json; DOCKER_CONFIG points there.",
		"The ephemeral-storage limit of the restore init container is large on purpose: when the",
		"  pod's other containers set none, the kubelet takes it as the pod's limit and counts every",
		"  disk-backed emptyDir (the staged state, the disk overlay) against it.",
	)
	notes := []note{
		{"- name: DOCKER_CONFIG", "Registry credentials: a directory with config.json, from the mounted pull secret."},
		{"secretName: " + o.PullSecret, "The pull secret, read-only; .dockerconfigjson becomes config.json."},
		{"defaultMode: 292", "0444: secret files belong to root and these containers are not; only " + pullers(o) + "."},
		{"- launch", "Starts QEMU once with -incoming, and cold (or not at all: --on-restart fail) on a restart."},
		{"- args: " + QEMUArgsPlaceholder, "The source VM's exact options, a JSON array, with -device vmgenid,guid=auto (a fresh VM generation ID per clone); -incoming is the launcher's to add."},
		{"- mountPath: " + path.Dir(o.QMPSocket), "QEMU's QMP socket directory: the root filesystem is read-only."},
		{"name: " + BackingContainerName, "The overlay's backing file, copied beside it unless there already."},
	}
	if o.RegistryCAConfigMap != "" {
		notes = append(notes, note{"- configMap:", "The registry's private CA (ca.pem) from ConfigMap " + o.RegistryCAConfigMap + ", passed as --ca-file; create it in the pod's namespace."})
	}
	if o.DecryptionKeySecret != "" {
		notes = append(notes,
			note{"secretName: " + o.DecryptionKeySecret, "The snapshots' decryption key (key.pem), passed as --decryption-key; create it in the pod's namespace."},
			note{"defaultMode: 288", "0440: root and the pod's fsGroup may read the key, others not (vmsnap refuses that)."},
			note{"fsGroup:", "The init container is not root: the key file's group lets it read the 0440 file."})
	}
	repeated := []string{"- name: DOCKER_CONFIG"}
	memFile := o.MemoryFile && !o.RestoreViaAgent
	stateLimit, ramLimit := "sizeLimit: "+o.RestoreStateSizeLimit.String(), "sizeLimit: "+o.RestoreRAMSizeLimit.String()
	switch {
	case o.RestoreViaAgent:
	case !memFile:
		notes = append(notes, note{stateLimit, "The staged VM state (compressed); the pod is evicted past this."})
	case stateLimit == ramLimit:
		notes = append(notes, note{stateLimit, "The staged device state; the RAM file, at least the guest's memory size (sparse: its zero pages take nothing). The pod is evicted past this."})
		repeated = append(repeated, stateLimit)
	default:
		notes = append(notes,
			note{stateLimit, "The staged device state (compressed; the RAM file is prepared apart); the pod is evicted past this."},
			note{ramLimit, "At least the guest's memory size: the RAM file is that large (sparse: its zero pages take nothing)."})
	}
	if memFile {
		notes = append(notes,
			note{"medium: Memory", "The guest's RAM file, the pod's own copy (never shared: QEMU 7.2 opens it read-write); counts against the pod's memory."},
			note{"name: " + PrepareContainerName, "Materializes the RAM file (each region verified) and records the QEMU arguments that map it for vmsnap launch; its memory limit covers the file, whose tmpfs pages it is charged for."})
	}
	return document{header: h, obj: pod, notes: notes, flow: []string{QEMUArgsPlaceholder}, repeated: repeated}
}

func pullers(o Options) string {
	if o.MemoryFile && !o.RestoreViaAgent {
		return RestoreContainerName + " and " + PrepareContainerName + " mount them"
	}
	return "this one mounts them"
}

func containerCount(o Options) string {
	if o.MemoryFile && !o.RestoreViaAgent {
		return "Four"
	}
	return "Three"
}

// restoreSteps explains what the restored pod's last two containers do.
func restoreSteps(o Options) []string {
	if o.RestoreViaAgent {
		return []string{
			"  " + RestoreContainerName + " pulls the disk overlay by digest, verifies every byte and puts it",
			"    at " + o.RestoreDiskPath + ". The VM state is the agent's to load (RestoreViaAgent).",
			"  qemu runs `vmsnap launch --defer`, which execs QEMU with the source VM's exact options",
			"    (${QEMU_ARGS}) and, on its first start only, -incoming defer. Then a controller asks",
			"    the agent on the node: vmsnap restore --agent unix://" + AgentSocket(o) + " --pod-uid UID",
			"    --container qemu --qmp " + o.QMPSocket + " --image STATE@DIGEST; the agent checks QEMU",
			"    against the recorded VM, then loads the state (include -qmp unix:" + o.QMPSocket + ",server=on,wait=off).",
			"",
		}
	}
	if o.MemoryFile {
		return []string{
			"  " + RestoreContainerName + " pulls the snapshot by digest, verifies every byte, puts the overlay at",
			"    " + o.RestoreDiskPath + " and stages the device state in " + o.RestoreStateDir + " (MemoryFile).",
			"  " + PrepareContainerName + " materializes the snapshot's RAM file in " + path.Join(o.RestoreRAMDir, "cache") + ", on the pod's",
			"    own emptyDir with medium: Memory (never shared with other pods or tenants), and records",
			"    the QEMU arguments that map it (share=off) in " + o.RestoreStateDir + "/prepared.json.",
			"  qemu runs `vmsnap launch`, which checks that record against the staged snapshot and execs",
			"    QEMU with the source VM's exact options (${QEMU_ARGS}), the RAM file's arguments and,",
			"    on its first start only, -incoming defer; a detached `vmsnap load` then checks QEMU",
			"    against the recorded VM, loads the device state over -qmp unix:" + o.QMPSocket + ",server=on,wait=off",
			"    (include it) and continues the VM. ${QEMU_ARGS} must not map the RAM itself: no",
			"    -object memory-backend-file for the machine's memory-backend, which the launcher adds.",
			"",
		}
	}
	return []string{
		"  " + RestoreContainerName + " pulls the snapshot by digest, verifies every byte, puts the overlay at",
		"    " + o.RestoreDiskPath + " and stages the VM state in " + o.RestoreStateDir + ".",
		"  qemu runs `vmsnap launch`, which execs QEMU with the source VM's exact options",
		"    (${QEMU_ARGS}) and, on its first start only, -incoming \"exec:vmsnap stream --dir",
		"    " + o.RestoreStateDir + " --qmp " + o.QMPSocket + "\": QEMU loads the staged state, and vmsnap",
		"    continues the VM over that monitor (include -qmp unix:" + o.QMPSocket + ",server=on,wait=off).",
		"    For a restore through the agent instead: vmsnap manifests --restore-via-agent.",
		"",
	}
}

func onRestartMeaning(mode string) string {
	if mode == "fail" {
		return "fails, saying why:\n  QEMU does not start"
	}
	return "boots QEMU cold,\n  from the disk as it is now, as after a crash"
}

// wrapWords lays words out in lines of at most width, each after indent.
func wrapWords(indent string, words []string, width int) []string {
	var lines []string
	cur := indent
	for _, w := range words {
		if cur != indent && len(cur)+1+len(w) > width {
			lines = append(lines, cur)
			cur = indent
		}
		if cur != indent {
			cur += " "
		}
		cur += w
	}
	return append(lines, cur)
}

// placeholders lists the distinct ${VAR}s in vals, in order.
func placeholders(vals ...string) []string {
	var names []string
	seen := map[string]bool{}
	for _, v := range vals {
		for {
			i := strings.Index(v, "${")
			if i < 0 {
				break
			}
			j := strings.IndexByte(v[i:], '}')
			if j < 0 {
				break
			}
			if n := v[i : i+j+1]; !seen[n] {
				seen[n] = true
				names = append(names, n)
			}
			v = v[i+j+1:]
		}
	}
	return names
}

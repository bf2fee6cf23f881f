package cluster

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Host settings the kubelet and the bridge CNI plugin change on the host:
// the kubelet sets its kernel tunables at start (protectKernelDefaults is
// off), the bridge plugin turns on forwarding for its gateway.
var touchedSysctls = []string{
	"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
	"net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding",
}

// iptablesCommands are the rule sets the kubelet (its canary and firewall
// chains) and the bridge plugin (masquerading) add to.
var iptablesCommands = []string{"iptables", "ip6tables"}

// hostState is what the cluster may change on the host, as it was before:
// saved in the cluster's directory so that a later run can put it back when
// this one dies without its cleanup.
type hostState struct {
	Sysctls  map[string]string
	IPTables map[string]string // command → its -save output
	Bridge   string
	Cgroup   string // the kubelet's cgroupRoot, below each hierarchy
}

func snapshotHost() (*hostState, error) {
	h := &hostState{Sysctls: map[string]string{}, IPTables: map[string]string{}}
	for _, s := range touchedSysctls {
		b, err := os.ReadFile("/proc/sys/" + s)
		if err != nil {
			continue // not on this kernel: nothing can change it either
		}
		h.Sysctls[s] = strings.TrimSpace(string(b))
	}
	for _, c := range iptablesCommands {
		out, err := exec.Command(c + "-save").Output()
		if err != nil {
			return nil, fmt.Errorf("%s-save: %v", c, err)
		}
		h.IPTables[c] = string(out)
	}
	return h, nil
}

func (h *hostState) save(path string) error {
	b, err := json.Marshal(h)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o600)
}

func loadHostState(path string) (*hostState, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var h hostState
	return &h, json.Unmarshal(b, &h)
}

// restore puts back the sysctls and iptables rules as they were, removes
// the bridge and the cgroups. It carries on past errors and returns them
// all.
func (h *hostState) restore() error {
	var errs []error
	if h.Bridge != "" {
		if _, err := os.Stat("/sys/class/net/" + h.Bridge); err == nil {
			if out, err := exec.Command("ip", "link", "del", h.Bridge).CombinedOutput(); err != nil {
				errs = append(errs, fmt.Errorf("ip link del %s: %v: %s", h.Bridge, err, out))
			}
		}
	}
	for s, v := range h.Sysctls {
		b, err := os.ReadFile("/proc/sys/" + s)
		if err == nil && strings.TrimSpace(string(b)) != v {
			if err := os.WriteFile("/proc/sys/"+s, []byte(v), 0o644); err != nil {
				errs = append(errs, fmt.Errorf("restoring sysctl %s=%s: %w", s, v, err))
			}
		}
	}
	for c, saved := range h.IPTables {
		if err := restoreIPTables(c, saved); err != nil {
			errs = append(errs, err)
		}
	}
	if h.Cgroup != "" {
		if err := removeCgroups(h.Cgroup); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// restoreIPTables replaces every table with its saved content. A table the
// saved output lacks (nothing was in it) is restored empty: its built-in
// chains with their current policies, no rules, no chains of its own.
func restoreIPTables(cmd, saved string) error {
	now, err := exec.Command(cmd + "-save").Output()
	if err != nil {
		return fmt.Errorf("%s-save: %v", cmd, err)
	}
	if string(now) == saved {
		return nil
	}
	in := saved
	savedTables := tables(saved)
	var table string
	sc := bufio.NewScanner(strings.NewReader(string(now)))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "*"):
			table = line[1:]
			if !savedTables[table] {
				in += line + "\n"
			}
		case savedTables[table]:
		case strings.HasPrefix(line, ":") && !strings.Contains(line, " - "):
			in += line + "\n" // a built-in chain: it has a policy
		case line == "COMMIT":
			in += line + "\n"
		}
	}
	c := exec.Command(cmd + "-restore")
	c.Stdin = strings.NewReader(in)
	if out, err := c.CombinedOutput(); err != nil {
		return fmt.Errorf("%s-restore: %v: %s", cmd, err, out)
	}
	return nil
}

func tables(save string) map[string]bool {
	t := map[string]bool{}
	for _, line := range strings.Split(save, "\n") {
		if strings.HasPrefix(line, "*") {
			t[line[1:]] = true
		}
	}
	return t
}

// cgroupHierarchies lists the cgroup hierarchies the kubelet and runc put
// pods in: every one mounted, the v2 "unified" one of a hybrid host too.
func cgroupHierarchies() []string {
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*")
	var out []string
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "cgroup.procs")); err == nil {
			out = append(out, d)
		}
	}
	return out
}

// createCgroups makes the kubelet's cgroupRoot in every hierarchy. A new
// cpuset cgroup has no CPUs and no memory nodes: it gets its parent's.
func createCgroups(name string) error {
	for _, h := range cgroupHierarchies() {
		d := filepath.Join(h, name)
		if err := os.Mkdir(d, 0o755); err != nil && !os.IsExist(err) {
			return err
		}
		if filepath.Base(h) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join(h, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(d, f), b, 0o644); err != nil {
					return fmt.Errorf("%s: %w", filepath.Join(d, f), err)
				}
			}
		}
	}
	return nil
}

// removeCgroups removes the cgroupRoot and everything below it, deepest
// first, once the processes in it are gone (retrying for a few seconds:
// a killed process leaves its cgroup a little after it dies).
func removeCgroups(name string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		var left []string
		for _, h := range cgroupHierarchies() {
			root := filepath.Join(h, name)
			var dirs []string
			filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
				if err == nil && d.IsDir() {
					dirs = append(dirs, p)
				}
				return nil
			})
			for i := len(dirs) - 1; i >= 0; i-- {
				if err := syscall.Rmdir(dirs[i]); err != nil && err != syscall.ENOENT {
					left = append(left, dirs[i])
				}
			}
		}
		if len(left) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroups still in use: %v", left)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// createBridge makes the CNI bridge in advance, with its gateway address,
// so that the kubelet and the test registry can listen on that address
// before the first pod exists (the bridge plugin takes it as it is).
func createBridge(name, gatewayCIDR string) error {
	for _, args := range [][]string{
		{"link", "add", "name", name, "type", "bridge"},
		{"addr", "add", gatewayCIDR, "dev", name},
		{"link", "set", name, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

// pickSubnet returns a random 10.x.y.0/24 that no route on the host uses.
func pickSubnet() (prefix string, err error) {
	routes, _ := exec.Command("ip", "-4", "route", "show", "table", "all").Output()
	for range 50 {
		x, _ := rand.Int(rand.Reader, big.NewInt(100))
		y, _ := rand.Int(rand.Reader, big.NewInt(256))
		p := fmt.Sprintf("10.%d.%d.", 100+x.Int64(), y.Int64())
		if !strings.Contains(string(routes), p) {
			return p, nil
		}
	}
	return "", errors.New("no free 10.x.y.0/24 subnet")
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

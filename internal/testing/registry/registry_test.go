package registry

import (
	"bufio"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestRegistryServesTLSWithAuth(t *testing.T) {
	r := Start(t)
	get := func(user, pass string) int {
		req, _ := http.NewRequest(http.MethodGet, "https://"+r.Host+"/v2/", nil)
		if user != "" {
			req.SetBasicAuth(user, pass)
		}
		resp, err := r.client(5 * time.Second).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if c := get(r.User, r.Password); c != http.StatusOK {
		t.Fatalf("right password: %d", c)
	}
	if c := get(r.User, "nope"); c != http.StatusUnauthorized {
		t.Fatalf("wrong password: %d", c)
	}
	if c := get("", ""); c != http.StatusUnauthorized {
		t.Fatalf("no password: %d", c)
	}
	// Plain HTTP is not served.
	if resp, err := http.Get("http://" + r.Host + "/v2/"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
			t.Fatalf("the registry answers plain HTTP: %s", resp.Status)
		}
	}
	if tags := r.Tags(t, "nothing/here"); len(tags) != 0 {
		t.Fatalf("tags of an unknown repository: %v", tags)
	}

	r.Kill()
	if r.Running() {
		t.Fatal("running after Kill")
	}
	if _, err := r.client(time.Second).Get("https://" + r.Host + "/v2/"); err == nil {
		t.Fatal("a killed registry still answers")
	}
	r.Restart(t)
	if c := get(r.User, r.Password); c != http.StatusOK {
		t.Fatalf("after Restart: %d", c)
	}
}

// The registry must not outlive a test binary that is killed (a test
// timeout does that, without running cleanups).
func TestRegistryDiesWithTestBinary(t *testing.T) {
	if os.Getenv("VMSNAP_TESTREGISTRY_CHILD") == "1" {
		r := Start(t)
		fmt.Printf("PID %d\n", r.Pid())
		time.Sleep(time.Minute)
		return
	}
	requireTools(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestRegistryDiesWithTestBinary$", "-test.v")
	cmd.Env = append(os.Environ(), "VMSNAP_TESTREGISTRY_CHILD=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := 0
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "PID "); ok {
			pid, _ = strconv.Atoi(p)
			break
		}
	}
	if pid == 0 {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatal("the child test printed no registry PID")
	}
	if !alive(pid) {
		t.Fatal("the registry is not running in the child")
	}
	t.Logf("child test runs registry %d; killing the child", pid)
	cmd.Process.Kill()
	cmd.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("registry %d survived its killed test binary", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// alive reports whether pid runs (a zombie does not).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || (s[i+2] != 'Z' && s[i+2] != 'X')
}

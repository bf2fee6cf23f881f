package e2e

// The registry pair and the copy tools of the interop tests
// (interop_e2e_test.go): a checkpoint pushed to one registry is copied to
// another by crane, oras and Debian's skopeo, each as its users run it.

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/ocischema"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	testtools "github.com/vmsnap/vmsnap/internal/testing/tools"
	"github.com/vmsnap/vmsnap/ociimage"
)

// regPair is two of Debian's docker-registry, each with its own TLS CA and
// password: checkpoints go to src, copies to dst.
type regPair struct {
	src, dst *registry.Registry
	both     string // a Docker config directory with both registries' credentials
	cas      string // a PEM file of both CAs
}

func startPair(t *testing.T) *regPair {
	t.Helper()
	p := &regPair{src: registry.Start(t), dst: registry.Start(t), both: t.TempDir()}
	auths := map[string]any{}
	var cas []byte
	for _, r := range []*registry.Registry{p.src, p.dst} {
		auths[r.Host] = map[string]string{"auth": base64.StdEncoding.EncodeToString([]byte(r.User + ":" + r.Password))}
		b, err := os.ReadFile(r.CAFile)
		if err != nil {
			t.Fatal(err)
		}
		cas = append(cas, b...)
	}
	b, _ := json.Marshal(map[string]any{"auths": auths})
	if err := os.WriteFile(filepath.Join(p.both, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	p.cas = filepath.Join(t.TempDir(), "cas.pem")
	if err := os.WriteFile(p.cas, cas, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// copyTool copies from (HOST/REPO:TAG on src) to to (HOST/REPO:TAG on dst).
type copyTool struct {
	name string
	run  func(t *testing.T, p *regPair, from, to string)
}

// copyTools are crane copy, oras cp -r (with referrers) and skopeo copy
// --all, the tools built first: a missing one skips (or fails in CI)
// before a guest boots.
func copyTools(t *testing.T) []copyTool {
	t.Helper()
	if _, err := exec.LookPath("skopeo"); err != nil {
		guest.SkipOrFail(t, "skopeo", "skopeo not installed (apt-get install skopeo; make deps)")
	}
	crane, oras := testtools.Crane.Path(t), testtools.ORAS.Path(t)
	return []copyTool{
		{"crane", func(t *testing.T, p *regPair, from, to string) {
			// crane takes credentials from DOCKER_CONFIG and CAs from
			// SSL_CERT_FILE, as Go programs do.
			runTool(t, []string{"DOCKER_CONFIG=" + p.both, "SSL_CERT_FILE=" + p.cas}, crane, "copy", from, to)
		}},
		{"oras", func(t *testing.T, p *regPair, from, to string) {
			runTool(t, nil, oras, "cp", "-r", "--no-tty", "--from-ca-file", p.src.CAFile, "--to-ca-file", p.dst.CAFile,
				"--from-registry-config", p.src.AuthFile, "--to-registry-config", p.dst.AuthFile, from, to)
		}},
		{"skopeo", func(t *testing.T, p *regPair, from, to string) {
			// --preserve-digests: skopeo fails rather than rewrite the
			// index or a manifest, so the copy is the same checkpoint.
			runTool(t, nil, "skopeo", "copy", "--all", "--preserve-digests", "--quiet",
				"--src-cert-dir", p.src.CertDir, "--src-authfile", p.src.AuthFile,
				"--dest-cert-dir", p.dst.CertDir, "--dest-authfile", p.dst.AuthFile, "docker://"+from, "docker://"+to)
		}},
	}
}

func runTool(t *testing.T, env []string, name string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(name), strings.Join(args, " "), err, out.String())
	}
}

// copyEverywhere copies each tag of repo on src with each tool, to
// TOOL/REPO:TAG on dst. Each copy's tag must name the digest the source's
// names (the checkpoint index, so the same checkpoint), and the source's
// and every copy's graph pass the image spec's schemas. It returns the
// copies' repositories on dst, HOST/TOOL/REPO, by tool.
func (p *regPair) copyEverywhere(t *testing.T, tools []copyTool, repo string, tags ...string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, tag := range tags {
		want := resolveIn(t, p.src, p.src.Host+"/"+repo+":"+tag)
		validateGraph(t, p.src, p.src.Host+"/"+repo, tag, want)
		for _, tool := range tools {
			to := p.dst.Host + "/" + tool.name + "/" + repo
			tool.run(t, p, p.src.Host+"/"+repo+":"+tag, to+":"+tag)
			if got := resolveIn(t, p.dst, to+":"+tag); got.Digest != want.Digest {
				t.Fatalf("%s copied %s:%s as %s, not %s: a copy must keep the checkpoint's digest", tool.name, repo, tag, got.Digest, want.Digest)
			}
			validateGraph(t, p.dst, to, tag, want)
			out[tool.name] = to
		}
	}
	return out
}

// resolveIn resolves ref in reg with its own credentials.
func resolveIn(t *testing.T, reg *registry.Registry, ref string) ocispec.Descriptor {
	t.Helper()
	r, err := ociimage.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := ociimage.Open(context.Background(), r, ociimage.WithRegistryConfig(reg.ConfigDir), ociimage.WithCAFile(reg.CAFile))
	if err != nil {
		t.Fatal(err)
	}
	d, err := repo.Resolve(context.Background())
	if err != nil {
		t.Fatalf("%s: %v", ref, err)
	}
	return d
}

// validateGraph checks every index, manifest and image config the tag
// names in repo against the image spec's schemas: a checkpoint index and
// at least its VM state manifest.
func validateGraph(t *testing.T, reg *registry.Registry, repo, tag string, want ocispec.Descriptor) {
	t.Helper()
	checked, err := ocischema.RegistryTag(context.Background(), repo, ":"+tag, reg.Remote()...)
	if err != nil {
		t.Fatalf("%s:%s against the image spec's schemas: %v", repo, tag, err)
	}
	if want.MediaType != ocispec.MediaTypeImageIndex || checked[ocispec.MediaTypeImageIndex] != 1 || checked[ocispec.MediaTypeImageManifest] < 1 {
		t.Fatalf("%s:%s: checked %v (a %s), want a checkpoint index and its manifests", repo, tag, checked, want.MediaType)
	}
}

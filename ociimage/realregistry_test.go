package ociimage

// Tests against a real registry: Debian's docker-registry (distribution 2.8)
// with TLS from a test CA and htpasswd auth (internal/testing/registry), and
// skopeo as an independent client.

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
)

func openReal(t *testing.T, reg *registry.Registry, repo string, opts ...Option) Repository {
	t.Helper()
	ref, err := ParseReference(reg.Host + "/" + repo)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Open(context.Background(), ref, append([]Option{WithCAFile(reg.CAFile), WithRegistryConfig(reg.ConfigDir)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestRealRegistryRoundTripAndSkopeo(t *testing.T) {
	reg := registry.Start(t)
	ctx := context.Background()
	repo := openReal(t, reg, "vms/web:snap-disk")
	if err := CheckAccess(ctx, repo); err != nil {
		t.Fatal(err)
	}
	descs, datas := testChunks(t, 8, 256<<10)
	start := time.Now()
	putChunks(t, repo, descs, datas)
	diskDesc := pushDisk(t, repo, descs[:4], nil)
	subject := diskDesc
	stateDesc, err := pushTagged(ctx, openReal(t, reg, "vms/web:snap"), Artifact{
		ArtifactType: ArtifactTypeVMState, ConfigMediaType: MediaTypeVMStateConfig, Config: regConfig{Name: "state"},
		Layers: descs[4:], Subject: &subject, Annotations: map[string]string{AnnotationMode: "pause"},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pushed 2 MiB in 8 chunks and two manifests in %v", time.Since(start))

	// Pull back through a fresh client, by tag and by digest.
	for _, r := range []string{"vms/web:snap", "vms/web@" + string(stateDesc.Digest)} {
		src := openReal(t, reg, r)
		var cfg regConfig
		desc, m, err := PullArtifact(ctx, src, ArtifactTypeVMState, &cfg)
		if err != nil {
			t.Fatalf("%s: %v", r, err)
		}
		if desc.Digest != stateDesc.Digest || cfg.Name != "state" || m.Subject == nil || m.Subject.Digest != diskDesc.Digest {
			t.Fatalf("%s: pulled %+v %+v", r, desc, m.Subject)
		}
		for i, l := range m.Layers {
			b, err := src.Blob(ctx, l, MaxChunkSize)
			if err != nil || string(b) != string(datas[4+i]) {
				t.Fatalf("chunk %d: %v", i, err)
			}
		}
	}

	// A client that puts a blob the repository holds without asking first
	// sends only the mount offer, which the registry answers 201: no body.
	puts := strings.Count(reg.LogTail(100000), `"PUT /v2/vms/web/blobs/uploads/`)
	if sent, err := openReal(t, reg, "vms/web:other").(*Registry).AddBlob(ctx, descs[0], datas[0]); err != nil || sent {
		t.Fatalf("AddBlob of a blob the registry holds: sent %v, %v; want nothing sent", sent, err)
	}
	log := reg.LogTail(100000)
	if !strings.Contains(log, "mount="+strings.Replace(string(descs[0].Digest), ":", "%3A", 1)+` HTTP/1.1" 201`) {
		t.Fatalf("no mount offer answered 201 for %s in the registry's log:\n%s", descs[0].Digest, reg.LogTail(10))
	}
	if n := strings.Count(log, `"PUT /v2/vms/web/blobs/uploads/`); n != puts {
		t.Fatalf("a put of a blob the registry holds sent a body (%d upload PUTs, %d before)", n, puts)
	}

	// distribution 2.8 has no referrers API: the fallback tag lists the
	// state image, and Referrers finds it there.
	fallback := strings.Replace(string(diskDesc.Digest), ":", "-", 1)
	if tags := reg.Tags(t, "vms/web"); !slices.Contains(tags, fallback) || !slices.Contains(tags, "snap") || !slices.Contains(tags, "snap-disk") {
		t.Fatalf("tags %v, want snap, snap-disk and the referrers tag %s", tags, fallback)
	}
	refs, err := openReal(t, reg, "vms/web@"+string(diskDesc.Digest)).Referrers(ctx, diskDesc)
	if err != nil {
		t.Fatal(err)
	}
	if len(refs) != 1 || refs[0].Digest != stateDesc.Digest || refs[0].ArtifactType != ArtifactTypeVMState {
		t.Fatalf("referrers of the disk image: %+v", refs)
	}

	// skopeo, an independent client, reads both manifests byte for byte.
	for _, want := range []ocispec.Descriptor{diskDesc, stateDesc} {
		sctx, cancel := context.WithTimeout(ctx, time.Minute)
		raw, err := registry.Skopeo(t, sctx, "inspect", "--raw", "--authfile", reg.AuthFile, "--cert-dir", reg.CertDir,
			"docker://"+reg.Host+"/vms/web@"+string(want.Digest))
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if got := digest.FromBytes(raw); got != want.Digest {
			t.Fatalf("skopeo read a manifest with digest %s, pushed %s:\n%s", got, want.Digest, raw)
		}
		var m ocispec.Manifest
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatal(err)
		}
		if m.ArtifactType != want.ArtifactType || m.MediaType != ocispec.MediaTypeImageManifest {
			t.Fatalf("skopeo sees artifactType %q, media type %q; pushed %q", m.ArtifactType, m.MediaType, want.ArtifactType)
		}
		t.Logf("skopeo inspect --raw read %s (%s, %d bytes)", want.Digest, m.ArtifactType, len(raw))
	}
}

func TestRealRegistryRefusals(t *testing.T) {
	reg := registry.Start(t)
	ctx := context.Background()
	descs, datas := testChunks(t, 1, 4096)

	// A wrong password: AUTH_FAILED with distribution's own words, and not
	// the password.
	wrong := openReal(t, reg, "vm:x", WithRegistryConfig(reg.WrongConfigDir))
	for name, err := range map[string]error{
		"check": CheckAccess(ctx, wrong),
		"put":   wrong.PutBlob(ctx, descs[0], datas[0]),
	} {
		if !errcode.Is(err, errcode.AuthFailed) || !strings.Contains(err.Error(), "UNAUTHORIZED: authentication required") {
			t.Fatalf("%s with a wrong password: %v (%s)", name, err, errcode.Of(err))
		}
		if strings.Contains(err.Error(), reg.Password) {
			t.Fatalf("the message holds the password: %v", err)
		}
		t.Logf("wrong password: %v", err)
	}

	// The test CA unknown: a TLS error that says what to do.
	ref, _ := ParseReference(reg.Host + "/vm:x")
	noCA, err := Open(ctx, ref, WithRegistryConfig(reg.ConfigDir))
	if err != nil {
		t.Fatal(err)
	}
	err = CheckAccess(ctx, noCA)
	if !errcode.Is(err, errcode.RegistryError) || !strings.Contains(err.Error(), "caFile") ||
		!strings.Contains(err.Error(), "certificate signed by unknown authority") {
		t.Fatalf("unknown CA: %v", err)
	}
	t.Logf("unknown CA: %v", err)

	// Nothing of the above left a blob or a tag behind.
	if n := reg.BlobCount(); n != 0 {
		t.Fatalf("%d blobs stored by refused clients", n)
	}

	// A stopped registry: REGISTRY_ERROR after the retries.
	reg.Kill()
	start := time.Now()
	_, err = openReal(t, reg, "vm:x", WithRetry(3, 10*time.Millisecond)).HasBlob(ctx, descs[0].Digest)
	if !errcode.Is(err, errcode.RegistryError) || !strings.Contains(err.Error(), "gave up after 3 tries") {
		t.Fatalf("stopped registry: %v", err)
	}
	t.Logf("stopped registry (%v): %v", time.Since(start), err)
}

# vmsnap — see README.md. Everything a test needs is installed by `make deps`.
SHELL := /bin/bash
GO ?= go
BIN := bin/vmsnap
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
# Debian packages the tests and the demo use. The Kubernetes test cluster
# (internal/testing/cluster) adds etcd, the CNI plugins, iptables and iproute2;
# its Kubernetes binaries are built from testdata/k8s (cached).
DEBS := qemu-system-x86 qemu-utils busybox-static zstd cpio containerd runc docker-registry skopeo apache2-utils \
	etcd-server containernetworking-plugins iptables iproute2
# Where the test guest (kernel + initramfs) is cached between runs.
export VMSNAP_TEST_CACHE ?= $(HOME)/.cache/vmsnap-test
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all build test test-loaded test-unit bench demo deps guest k8s tools cosign vet lint clean print-debs

all: build

build:
	$(GO) build -trimpath -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/vmsnap

# Installs the Debian packages that are missing (apt-get update first).
deps:
	@missing=$$(for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing:" $$missing; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

print-debs:
	@echo $(DEBS)

# The test guests: a busybox initramfs on Debian's cloud kernel, and on its
# generic kernel (pinned in build.sh; it has the vmgenid driver the clone
# tests need), each cached.
guest:
	testdata/guest/build.sh $(VMSNAP_TEST_CACHE)/guest
	testdata/guest/build.sh --kernel generic $(VMSNAP_TEST_CACHE)/guest-generic

vet:
	$(GO) vet ./...

# staticcheck, pinned: a version that knows this Go (v0.8 for Go 1.26).
# `go run pkg@version` builds it from the module proxy into the build
# cache once, outside this module's go.mod. A line it must not report
# carries //lint:ignore CHECK reason.
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2

# Formatting, vet, a tidy go.mod, staticcheck, every fuzz target in
# FUZZ_TARGETS, and the tree's own rules (internal/testing/structure: no
# function over 100 lines). `make test` runs it first.
lint: vet
	$(GO) test -count=1 ./internal/testing/structure
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt -l: run gofmt -w on:"; echo "$$out"; exit 1; fi
	$(GO) mod tidy -diff
	$(GO) run $(STATICCHECK) ./...
	@missing=$$(grep -r --include='*_test.go' -o '^func Fuzz[A-Za-z0-9_]*' . | \
		sed -E 's|^(.*)/[^/]*_test\.go:func (Fuzz.*)$$|\1:\2|' | \
		while read -r t; do case " $(FUZZ_TARGETS) " in *" $$t "*) ;; *) echo "$$t";; esac; done); \
	if [ -n "$$missing" ]; then echo "fuzz targets missing from FUZZ_TARGETS in the Makefile:" $$missing; exit 1; fi

# The Kubernetes binaries of the test cluster, built once into
# $(VMSNAP_TEST_CACHE)/k8s (about 6 minutes on 2 cores from a cold Go cache),
# before the tests that measure time run beside the build.
k8s:
	$(GO) test -count=1 -timeout 40m -run '^TestBinaries$$' ./internal/testing/cluster

# The copy tools of the interop tests (crane, oras), built from the Go module
# proxy at pinned versions into $(VMSNAP_TEST_CACHE)/tools (about a minute
# each), before the tests that measure time run beside the build.
tools:
	$(GO) test -count=1 -run '^TestToolsArePinned$$/^(crane|oras)$$' ./internal/testing/tools

# Lint (make lint), then all tests, including the end-to-end ones on real
# QEMU guests (TCG) and on a real single-node Kubernetes cluster. Installs what they need first. The
# cluster's packages run after the rest, not beside it: a cluster with QEMU
# guests in its pods is the heaviest load on the machine, and the other
# end-to-end tests' guests would share two cores with it.
# The cosign CLI of the signature tests (internal/testing/tools, about 7 minutes
# on 2 cores once, then cached) builds in the background from the start of
# the tests, beside the packages that do not need it; the tests that do
# wait for it (a file lock), and one that finds no binary builds it itself.
# internal/testing/e2e comes first: it takes longer than all the others
# together, and go test starts packages in the order it is given them (two
# at a time on 2 cores), so the others run beside it instead of before it.
# Its tests run two at a time (t.Parallel; -parallel is GOMAXPROCS): each
# waits on QEMU, registries and child processes much of the time.
CLUSTER_PKGS := ./internal/testing/cluster ./internal/testing/k8se2e
test: lint deps guest k8s tools
	@mkdir -p bin
	$(GO) test -count=1 -timeout 60m -run '^TestToolsArePinned$$/^cosign$$' ./internal/testing/tools >bin/cosign-build.log 2>&1 & \
	$(GO) test -race -timeout 45m ./internal/testing/e2e $$($(GO) list ./... | grep -v -e /internal/testing/cluster -e /internal/testing/k8se2e -e /internal/testing/tools -e /internal/testing/e2e); \
	status=$$?; wait $$! || { cat bin/cosign-build.log; status=1; }; exit $$status
	$(GO) test -race -timeout 20m $(CLUSTER_PKGS)

# make test with the machine's cores kept busy by another process, to show
# that no test needs an idle machine: LOAD_CPUS shell loops spin at normal
# priority for as long as make test runs, and are killed when it ends.
LOAD_CPUS ?= $(shell nproc)
test-loaded:
	@pids=; for i in $$(seq $(LOAD_CPUS)); do sh -c 'while :; do :; done' & pids="$$pids $$!"; done; \
	trap 'kill $$pids 2>/dev/null' EXIT INT TERM; \
	echo "test-loaded: $(LOAD_CPUS) busy loops (pids$$pids) beside make test"; \
	$(MAKE) test

# The cosign CLI alone, into the test cache.
cosign:
	$(GO) test -count=1 -timeout 60m -run '^TestToolsArePinned$$/^cosign$$' ./internal/testing/tools

# Fast unit tests only: fakes, no guest.
test-unit:
	$(GO) test -race -short ./...

# Benchmarks, one package at a time (-p 1: they measure CPU time on a shared
# machine). BenchmarkE2E (internal/testing/e2e/bench_test.go) prints a table: QEMU's
# own stream rate, a scripted zstd + skopeo baseline and vmsnap, through a
# TLS + auth registry, plus peak RSS, live downtime and incremental uploads
# (BenchmarkE2E/stream); it also writes a CPU profile of one checkpoint to
# bin/bench-cpu.pprof. BenchmarkE2E/memfile sets the memory-file format
# against the stream path on 1 and 4 GiB guests (bench_memfile_test.go),
# both paths on QEMU 10 (under TCG a snapshot pre-copies only from QEMU 9.0
# on); VMSNAP_BENCH_MF_QEMU=system runs them on the system's QEMU.
# One section alone: make bench BENCH=E2E/memfile
BENCH ?= .
bench: deps build guest
	VMSNAP_BIN=$(CURDIR)/$(BIN) VMSNAP_BENCH_CPUPROFILE=$(CURDIR)/bin/bench-cpu.pprof \
		$(GO) test -p 1 -run '^$$' -bench '$(BENCH)' -benchtime 1x -timeout 40m ./...

# Boots the test guest, checkpoints it into a local OCI layout, restores it
# into a fresh QEMU and shows that the guest did not notice.
demo: deps build guest
	testdata/demo.sh $(BIN) $(VMSNAP_TEST_CACHE)/guest

clean:
	rm -rf bin

# Every fuzz target for FUZZTIME each (not run by CI by default: the seeds
# alone run as ordinary tests in `make test`). Crashers land in the
# package's testdata/fuzz/FuzzX/ directory; keep them as regression seeds.
FUZZTIME ?= 10s
FUZZ_TARGETS := \
	./ociimage:FuzzLayoutPull ./ociimage:FuzzParseDigest ./ociimage:FuzzReadCheckpoint ./ociimage:FuzzVerifySignature \
	./ociimage/chunk:FuzzDecodeStream ./ociimage/chunk:FuzzValidateLayers ./vmstate:FuzzRecord ./vmstate:FuzzReadPrecopy \
	./qmp:FuzzClientReplies \
	./agent:FuzzCheckpointRequest ./agent:FuzzAllowRepository \
	./agent/containerd:FuzzHostPath ./agent/containerd:FuzzResolveNames \
	./vmstate/disk:FuzzReadHeader ./internal/fusefs:FuzzRequest \
	./vmstate/ramfile:FuzzParseIndex \
	./cmd/vmsnap:FuzzErrorRendering
.PHONY: fuzz
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		echo "== $${t%%:*} $${t##*:} ($(FUZZTIME))"; \
		$(GO) test -run '^$$' -fuzz "^$${t##*:}\$$" -fuzztime $(FUZZTIME) "$${t%%:*}"; \
	done

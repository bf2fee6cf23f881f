package main

import (
	"context"
	"fmt"
	"os"
	"runtime/pprof"
	"testing"
)

// cliProfileEnv, set to a file name, makes this test binary run as the
// vmsnap command line it was given, under a CPU profile written to that
// file, instead of running tests. The benchmark in internal/testing/e2e uses it to
// profile one real checkpoint, flags and all: the vmsnap binary itself has
// no profiling switch, and a test-only one keeps it that way.
const cliProfileEnv = "VMSNAP_TEST_CLI_CPUPROFILE"

func TestMain(m *testing.M) {
	if p := os.Getenv(cliProfileEnv); p != "" {
		os.Exit(profiledRun(p, os.Args[1:]))
	}
	os.Exit(m.Run())
}

func profiledRun(profile string, args []string) int {
	f, err := os.Create(profile)
	if err != nil {
		fmt.Fprintf(os.Stderr, "vmsnap test binary: %v\n", err)
		return 1
	}
	defer f.Close()
	if err := pprof.StartCPUProfile(f); err != nil {
		fmt.Fprintf(os.Stderr, "vmsnap test binary: %v\n", err)
		return 1
	}
	defer pprof.StopCPUProfile()
	return run(context.Background(), args, os.Stdout, os.Stderr)
}

//go:build linux

package main

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testregistry"
)

func BenchmarkExp(b *testing.B) {
	bb := &bench{b: b, runs: 1}
	bb.reg = testregistry.Start(b)
	src, boot := bb.boot(benchMemMB, benchDataMB, nil)
	cfgs := strings.Fields(os.Getenv("EXP_CONFIGS"))
	for _, c := range cfgs {
		var w, ch int
		fmt.Sscanf(c, "w%dc%d", &w, &ch)
		extra := []string{"--workers", fmt.Sprint(w), "--chunk-size", fmt.Sprint(ch << 20)}
		for i := 0; i < 2; i++ {
			bb.limit(src, false)
			var cp api.CheckpointResult
			t := bb.runCLI(src, &cp, append([]string{"checkpoint", "--qmp", src.QMPPath(), "--image", bb.repo("exp") + ":s", "--mode", "pause"}, extra...)...)
			qmpOnce(b, src.QMPPath(), "cont", nil)
			fmt.Printf("%s ckpt %.2fs cpu %s phases %v\n", c, t.d.Seconds(), t.cpu, cp.VMState.DurationsMs)
			if i == 1 {
				target := bb.target()
				var res api.RestoreResult
				rt := bb.runCLI(target, &res, append([]string{"restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image}, "--workers", fmt.Sprint(w))...)
				bb.resumed(target, boot)
				target.Kill()
				fmt.Printf("%s restore %.2fs cpu %s phases %v\n", c, rt.d.Seconds(), rt.cpu, res.VMState.DurationsMs)
			}
		}
	}
	_ = time.Second
}

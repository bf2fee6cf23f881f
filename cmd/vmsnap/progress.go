package main

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"
)

// progress prints a self-overwriting line with bytes and MB/s while a long
// phase runs, on a terminal only (phasedProgress makes one per phase): logs
// and scripts get the result alone.
type progress struct {
	w     io.Writer
	label string
	start time.Time

	mu    sync.Mutex
	last  time.Time
	done  int64
	shown bool
}

func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// update records bytes done; it is cheap enough to call for every chunk.
// A nil progress does nothing.
func (p *progress) update(done int64) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done = done
	if now := time.Now(); now.Sub(p.last) >= 200*time.Millisecond {
		p.last = now
		p.print()
	}
}

func (p *progress) print() {
	secs := time.Since(p.start).Seconds()
	rate := 0.0
	if secs > 0 {
		rate = float64(p.done) / secs / 1e6
	}
	fmt.Fprintf(p.w, "\r\033[K%s: %s, %.1f MB/s", p.label, humanBytes(p.done), rate)
	p.shown = true
}

// finish ends the progress line.
func (p *progress) finish() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.shown {
		p.print()
		fmt.Fprintln(p.w)
	}
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// phasedProgress shows one progress line per phase of an operation
// ("vmstate", then "disk", ...). A nil one (not a terminal) does nothing.
type phasedProgress struct {
	w     io.Writer
	mu    sync.Mutex
	phase string
	cur   *progress
}

func newPhasedProgress(w io.Writer) *phasedProgress {
	if f, ok := w.(*os.File); !ok || !isTerminal(f) {
		return nil
	}
	return &phasedProgress{w: w}
}

// update matches snapshot.Progress.
func (p *phasedProgress) update(phase string, done int64) {
	if p == nil {
		return
	}
	p.mu.Lock()
	if phase != p.phase {
		p.cur.finish()
		p.phase, p.cur = phase, &progress{w: p.w, label: phase, start: time.Now()}
	}
	cur := p.cur
	p.mu.Unlock()
	cur.update(done)
}

func (p *phasedProgress) finish() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cur.finish()
	p.cur, p.phase = nil, ""
}

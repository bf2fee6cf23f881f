package agent

import (
	"sync"
	"time"
)

// placedCache remembers the callers the agent placed, by process (pid and
// start time: the same process, for as long as it lives), for a while: a
// client's next connections, and a flood from one process, are placed by
// one read of /proc/PID/stat instead of a containerd lookup each. A
// process does not leave its container, and the entry expires anyway.
type placedCache struct {
	mu    sync.Mutex
	byPID map[int32]placedEntry
	order []int32 // pids, oldest entry first
}

type placedEntry struct {
	start  time.Duration // the process's start time
	caller Caller
	until  time.Time
}

const (
	placedMax = 4096
	placedTTL = 10 * time.Second
)

func (pc *placedCache) get(pid int32, start time.Duration) (Caller, bool) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	e, ok := pc.byPID[pid]
	if !ok || e.start != start || time.Now().After(e.until) {
		return Caller{}, false
	}
	return e.caller, true
}

func (pc *placedCache) put(pid int32, start time.Duration, c Caller) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.byPID == nil {
		pc.byPID = map[int32]placedEntry{}
	}
	if _, ok := pc.byPID[pid]; !ok {
		pc.order = append(pc.order, pid)
	}
	pc.byPID[pid] = placedEntry{start: start, caller: c, until: time.Now().Add(placedTTL)}
	for len(pc.order) > placedMax {
		delete(pc.byPID, pc.order[0])
		pc.order = pc.order[1:]
	}
}

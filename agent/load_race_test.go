//go:build race

package agent

// raceEnabled: the race detector distorts CPU costs, so timing ratios are
// logged, not asserted (load_test.go).
const raceEnabled = true

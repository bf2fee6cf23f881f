package snapshot

import "testing"

// --workers reaches Stage as given: one means one blob at a time, not the
// default; only an unset count takes the default.
func TestStageWorkersHonoursTheCallersCount(t *testing.T) {
	for n, want := range map[int]int{0: DefaultStageWorkers, -1: DefaultStageWorkers, 1: 1, 2: 2, 9: 9} {
		if got := stageWorkers(n); got != want {
			t.Errorf("stageWorkers(%d) = %d, want %d", n, got, want)
		}
	}
}

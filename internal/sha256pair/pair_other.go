//go:build !amd64 || purego

package sha256pair

const useSHANI = false

func blocksSHANI(h1, h2 *[8]uint32, p []byte) { panic("unreachable") }

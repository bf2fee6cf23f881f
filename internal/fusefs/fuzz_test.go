package fusefs

import (
	"context"
	"testing"
)

// FuzzRequest feeds the parser and every handler bytes the kernel never
// sends: nothing may panic (the per-request recover is not in this path),
// and every answer is a well-formed reply to the request's unique.
func FuzzRequest(f *testing.F) {
	tree, _ := newTestTree(f)
	seed := func(op uint32, node uint64, body []byte) {
		b := make([]byte, inHeaderSize+len(body))
		le.PutUint32(b[0:], uint32(len(b)))
		le.PutUint32(b[4:], op)
		le.PutUint64(b[8:], 42)
		le.PutUint64(b[16:], node)
		copy(b[inHeaderSize:], body)
		f.Add(b)
	}
	for op := uint32(1); op <= 53; op++ {
		seed(op, nodeRAM, make([]byte, 40))
	}
	seed(opInit, 0, initBody(45, 1<<44-1))
	seed(opLookup, nodeVol, []byte("ram\x00"))
	seed(opReaddir, nodeVol, readBody(1, 4096))
	seed(opRead, nodeRAM, readBody(fileSize-10, 4096))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := parseRequest(b)
		if err != nil {
			return
		}
		s := newServer(tree)
		var m []byte
		switch r.op {
		case opInit:
			m, _, _ = initReply(r)
		case opInterrupt:
			s.interrupt(r)
			return
		default:
			m = s.dispatch(context.Background(), r)
		}
		if len(m) < outHeaderSize || int(le.Uint32(m)) != len(m) || le.Uint64(m[8:]) != r.unique || int32(le.Uint32(m[4:])) > 0 {
			t.Fatalf("opcode %d: reply %x", r.op, m[:min(len(m), outHeaderSize)])
		}
	})
}

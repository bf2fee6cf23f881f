package mounter

import "sync"

// keyedMutex serializes the operations on one target, and only those: a
// publish stalled on its source (a FUSE server that does not answer a
// lookup) holds up no other volume.
type keyedMutex struct {
	mu   sync.Mutex
	held map[string]chan struct{}
}

// lock waits until key is free, takes it, and returns its release.
func (k *keyedMutex) lock(key string) (unlock func()) {
	for {
		k.mu.Lock()
		if k.held == nil {
			k.held = map[string]chan struct{}{}
		}
		busy, ok := k.held[key]
		if !ok {
			done := make(chan struct{})
			k.held[key] = done
			k.mu.Unlock()
			return func() {
				k.mu.Lock()
				delete(k.held, key)
				k.mu.Unlock()
				close(done)
			}
		}
		k.mu.Unlock()
		<-busy
	}
}

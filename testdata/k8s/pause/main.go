// Command pause is the test cluster's pod sandbox process (containerd's
// sandbox_image): it holds the pod's namespaces and does nothing else until
// it is told to stop. As PID 1 of its container it must handle SIGTERM and
// SIGINT itself, or the kernel would ignore them.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	<-c
}

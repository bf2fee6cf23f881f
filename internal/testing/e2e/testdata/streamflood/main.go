// streamflood floods the agent with event stream requests
// (internal/testing/streamflood) from inside a container, prints what it saw as
// JSON and exits, closing its streams.
//
//	streamflood SOCKET ATTEMPTS WORKERS
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strconv"

	"github.com/vmsnap/vmsnap/internal/testing/streamflood"
)

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: streamflood SOCKET ATTEMPTS WORKERS")
		os.Exit(2)
	}
	attempts, err1 := strconv.Atoi(os.Args[2])
	workers, err2 := strconv.Atoi(os.Args[3])
	if err1 != nil || err2 != nil {
		fmt.Fprintln(os.Stderr, "ATTEMPTS and WORKERS are numbers")
		os.Exit(2)
	}
	r, held := streamflood.Run(os.Args[1], attempts, workers)
	b, _ := json.Marshal(r)
	fmt.Println(string(b))
	for _, c := range held {
		c.Close()
	}
}

// agentcall sends one request to the agent's socket and prints the status
// and what the body held within a second: the tests run it inside a
// container, as a caller of some pod namespace, where no curl is.
//
//	agentcall SOCKET METHOD PATH
package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"
)

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: agentcall SOCKET METHOD PATH")
		os.Exit(2)
	}
	sock, method, path := os.Args[1], os.Args[2], os.Args[3]
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	// An event stream never ends by itself: a second of it is enough.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, method, "http://agent"+path, nil)
	resp, err := c.Do(req)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer resp.Body.Close()
	fmt.Println(resp.StatusCode)
	_, _ = io.Copy(os.Stdout, resp.Body)
}

//go:build !unix

package throttle

import (
	"net"
	"testing"
)

// closedAddr returns an address nothing listened on when it returned: a
// port listened on and closed again, which the next listener on the
// machine may take (closedaddr_unix_test.go holds its port).
func closedAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

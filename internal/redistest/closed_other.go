//go:build !unix

package redistest

import (
	"net"
	"testing"
)

// ClosedAddr returns an address on 127.0.0.1 that nothing listened on when
// it returned: a port listened on and closed again, which the next
// listener on the machine may take (closed_unix.go holds its port).
func ClosedAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

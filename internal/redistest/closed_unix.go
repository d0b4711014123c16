//go:build unix

package redistest

import (
	"fmt"
	"syscall"
	"testing"
)

// ClosedAddr returns an address on 127.0.0.1 that nothing listens on, and
// nothing can until the test ends: a socket bound to it that does not
// listen, so that a dial is refused. A port listened on and closed again
// could be taken by the next listener on the machine, which would then
// accept the dial (once in CI's race run, 12-06).
func ClosedAddr(t testing.TB) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
}

//go:build unix

package throttle

import (
	"fmt"
	"syscall"
	"testing"
)

// closedAddr returns an address nothing listens on, and nothing can until
// the test ends: a socket bound to it that does not listen, so that a dial
// is refused. A port listened on and closed again (as before) could be
// taken by the next listener on the machine: a server of this test, or a
// redis-server of another package's tests beside it, which then accepted
// the dial (once in CI's race run, 12-06).
func closedAddr(t *testing.T) string {
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

package redistest

import "syscall"

// sysProcAttr makes the kernel kill the server if the test binary dies
// without running cleanups (a -timeout panic, SIGKILL), so no orphaned
// redis-server keeps holding a port. The signal is tied to the forking OS
// thread, and Go only retires a thread when a goroutine exits while locked
// to it; code that does that in tests would see servers die early.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

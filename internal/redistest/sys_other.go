//go:build !linux

package redistest

import "syscall"

// sysProcAttr has no parent-death signal to offer outside Linux; servers
// are still killed at cleanup.
func sysProcAttr() *syscall.SysProcAttr { return nil }

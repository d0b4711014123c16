//go:build unix

package redistest

import (
	"os"
	"syscall"
)

// Signals behind Freeze and Thaw.
var (
	sigStop os.Signal = syscall.SIGSTOP
	sigCont os.Signal = syscall.SIGCONT
)
